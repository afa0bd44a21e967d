"""The memory ledger: what autograd really saves (saved-tensor hooks) against the memory model's prediction
(bench/core/memory_model/counting.py, compose.py, states.py), and DeepSpeed stage 3's parameter rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ptbench.core.memory import SavedTensorLedger
from ptbench.core.memory_model import (
    activation_elements,
    pipeline_layers,
    predict,
    stage_activation_elements,
    zero3_gathered,
)
from ptbench.workloads.vision import build_vision_model, vision_sequential
from tests.helpers import bench, only_run, summary


def test_ledger_counts_each_storage_once_and_frees_at_backward():
    lin = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with SavedTensorLedger([lin]) as led:
        h = lin(x)  # saves x (2 KiB); the weight is a parameter, not counted
        y = torch.relu(h)  # saves its output (1 KiB)
        z = (y.view(-1) * y.view(-1)).sum()  # two views of one storage saved: counted once
        assert led.current == 8 * 64 * 4 + 8 * 32 * 4
        z.backward()
    assert led.peak == 8 * 64 * 4 + 8 * 32 * 4 and led.current == 0


def test_ledger_peak_is_what_is_alive_at_once():
    w = nn.Parameter(torch.randn(16, 16))
    with SavedTensorLedger() as led:
        a = (torch.randn(4, 16, requires_grad=True) @ w).sum()
        b = (torch.randn(4, 16, requires_grad=True) @ w).sum()  # two graphs alive: 2 x 256 B of inputs
        a.backward()
        c = (torch.randn(4, 16, requires_grad=True) @ w).sum()  # a's freed first: still 2 alive
        b.backward()
        c.backward()
    assert led.peak == 2 * 4 * 16 * 4 and led.total == 3 * 4 * 16 * 4 and led.current == 0


@pytest.mark.parametrize("arch", ["vgg16", "resnet50"])
def test_pipeline_layers_are_the_workloads_sequential_form(arch):
    with torch.device("meta"):
        model = build_vision_model(arch, 10, 32, 8)
    ours, theirs = pipeline_layers(model), list(vision_sequential(model))
    assert [type(m) for m in ours] == [type(m) for m in theirs]
    assert all(a is b for a, b in zip(ours, theirs) if not isinstance(a, nn.Flatten))
    stages = stage_activation_elements(model, (3, 32, 32), [len(ours) // 2, len(ours) - len(ours) // 2])
    # each stage counts its own received input too, so the stages together hold at least the whole model's
    assert sum(stages) >= activation_elements(model, (3, 32, 32)) and stages[0] > stages[1]


def test_zero3_keeps_everything_gathered_at_small_scale_and_not_beyond():
    numels = [50_000, 2_000_000, 3_000_000]  # one tensor under the persistence threshold
    small = zero3_gathered(numels, 4, 3_000_000)
    assert small["persistent"] == 50_000 and small["partition"] == 50_000 + 500_000 + 750_000
    assert small["gathered"] == 5_000_000  # every non-persistent element stays gathered forward -> backward
    big = zero3_gathered(numels, 4, 3_000_000, max_reuse_distance=1_000_000, prefetch_bucket_size=500_000)
    assert big["gathered"] == 3_500_000  # released after use: largest unit + prefetch bucket
    shapes = [(n,) for n in numels]
    p = predict(
        "zero3",
        params=sum(numels),
        world_size=4,
        shapes=shapes,
        largest_unit_params=3_000_000,
        zero3_settings={"param_persistence_threshold": 100_000},
    )
    assert p["params"] == 4 * small["partition"] and p["transient"] == 4 * 5_000_000


GPIPE = ["adapter=gpipe", "adapter.pipeline_parallel=2", "adapter.microbatches=4", "launcher.nprocs=1"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["workload=gpt2_tiny", "workload.vocab_size=1024", "adapter=ddp", "launcher.nprocs=2"],
        ["workload=resnet50_tiny", "adapter=pipeline", "adapter.microbatches=4", "launcher.nprocs=2"],
        # torchgpipe, checkpointing except_last (its default): 2 partitions counted on their worker thread
        ["workload=gpt2_tiny", "workload.vocab_size=1024", *GPIPE, "adapter.balance=[2,2]"],
        ["workload=resnet50_tiny", *GPIPE, "adapter.balance=[12,11]"],
        # GPipe at one partition (a one-GPU smoke): its m micro-batches, checkpointing and the loss on the
        # gathered mini-batch still apply (the model once counted one micro-batch there: 27 MiB for 100 counted)
        [
            "workload=gpt2_tiny",
            "workload.vocab_size=1024",
            "adapter=gpipe",
            "adapter.pipeline_parallel=1",
            "adapter.microbatches=4",
        ],
        ["workload=resnet50_tiny", "adapter=gpipe", "adapter.pipeline_parallel=1", "adapter.microbatches=4"],
    ],
)
def test_run_records_predicted_within_10_percent_of_counted(tmp_path, overrides):
    proc = bench(
        "experiment=smoke",
        "trainer.max_steps=3",
        "trainer.untimed_steps=2",
        "trainer.batch_size=8",
        *overrides,
        results=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    led = summary(only_run(tmp_path))["memory_ledger"]
    parts = 1 if "adapter.pipeline_parallel=1" in overrides else 2
    assert len(led["counted_saved_bytes_per_rank"]) == parts and min(led["counted_saved_bytes_per_rank"]) > 0
    assert led["ratio"] == pytest.approx(1.0, abs=0.10), led


@pytest.mark.parametrize(
    ("checkpoint", "first", "expected"),
    [
        # b = 2 rows per micro-batch, m = 4, fp32. Partition 0 saves each micro-batch's input x (64 B) and ReLU
        # output (128 B); partition 1's Linear saves its input, that ReLU output: a storage partition 0 saves too,
        # counted for each (on a cluster each device keeps its own copy).
        ("never", "linear", [4 * (64 + 128), 4 * 128]),
        # checkpointed: each micro-batch's partition input kept (torchgpipe's Checkpoint and Recompute nodes) and
        # one micro-batch recomputed at a time in backward; except_last's last micro-batch, kept whole, is freed
        # before the first recomputation, so both modes peak at m inputs + one ReLU output on partition 0
        ("except_last", "linear", [4 * 64 + 128, 4 * 128]),
        ("always", "linear", [4 * 64 + 128, 4 * 128]),
        # integer input (token ids, an Embedding first: indices 16 B, its output 64 B): the ids cannot carry
        # torchgpipe's micro-batch ordering into backward, and two micro-batches are recomputed at once
        ("never", "embedding", [4 * (16 + 64 + 128), 4 * 128]),
        ("always", "embedding", [2 * 16 + 2 * (16 + 64 + 128), 4 * 128]),
    ],
)
def test_gpipe_partitions_count_what_their_worker_threads_save(checkpoint, first, expected):
    """A real torchgpipe GPipe on CPU (2 partitions, 4 micro-batches): its worker thread runs the partitions,
    where the ledger's hooks on this thread do not reach; the adapter's wrapping counts each partition."""
    pytest.importorskip("torchgpipe")
    from torchgpipe import GPipe

    from ptbench.adapters.gpipe import count_partitions

    def step(wrap: bool) -> SavedTensorLedger:
        torch.manual_seed(0)
        layers = [nn.Embedding(10, 8)] if first == "embedding" else []
        model = nn.Sequential(*layers, nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        gpipe = GPipe(model, balance=[len(model) - 1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
        if wrap:
            count_partitions(gpipe)
        x = torch.randint(0, 10, (8,)) if first == "embedding" else torch.randn(8, 8)
        with SavedTensorLedger([gpipe]) as led:
            gpipe(x).sum().backward()
        return led

    led = step(wrap=True)
    assert led.result()["per_partition"] == expected
    assert led.current == 0 and all(alive == 0 for alive, _ in led.parts.values())  # all freed by backward
    if checkpoint == "never":  # without the partitions' counting the step's hooks see nothing of the forward
        assert step(wrap=False).result() == {"peak_bytes": 0, "total_bytes": 0, "tensors": 0}


def test_harness_loss_saves_one_softmax_and_matches_cross_entropy():
    """workloads/gpt2.py's loss: one exp pass, the fp32 softmax saved (not the logits) and scaled in place into
    the gradient; the loss and gradient of F.cross_entropy on the fp32 logits; double backward refused."""
    import torch.nn.functional as F

    from ptbench.workloads.gpt2 import _CrossEntropy

    torch.manual_seed(0)
    z = (3 * torch.randn(300, 5000)).requires_grad_()
    t = torch.randint(0, 5000, (300,))
    with SavedTensorLedger() as led:
        loss = _CrossEntropy.apply(z, t)
    assert led.total == 300 * 5000 * 4 + 300 * 8  # the softmax and the targets
    (g,) = torch.autograd.grad(loss, z)
    ref = F.cross_entropy(z, t)
    (g_ref,) = torch.autograd.grad(ref, z)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(g, g_ref, atol=1e-8)
    with pytest.raises(RuntimeError):
        (g2,) = torch.autograd.grad(_CrossEntropy.apply(z, t), z, create_graph=True)
        g2.sum().backward()


def _zero3_rank(rank: int, port: int, threshold: int, out: str) -> None:
    """One rank of a real DeepSpeed stage-3 engine (CPU, gloo) on gpt2_tiny: the elements gathered (AVAILABLE)
    right after forward, per step, written by rank 0."""
    import json
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from ptbench.workloads.gpt2 import GPT2, GPT2Config

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as adapters/zero.py: gloo does the work
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(1024, 64, 2, 4, 128, 0.0))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    x = torch.randint(0, 1024, (2, 64))
    gathered = []
    for _ in range(3):
        logits = engine(x)
        gathered.append(sum(p.ds_numel for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE))
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 1024), x.reshape(-1)))
        engine.step()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("threshold", [0, 100_000])
def test_deepspeed_stage3_keeps_what_the_model_says_gathered(tmp_path, threshold):
    import json

    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port
    from ptbench.workloads.gpt2 import GPT2, GPT2Config

    pytest.importorskip("deepspeed")
    out = tmp_path / "gathered.json"
    mp.spawn(_zero3_rank, args=(free_port(), threshold, str(out)), nprocs=2)
    first, *later = json.loads(out.read_text())
    with torch.device("meta"):
        numels = [p.numel() for p in GPT2(GPT2Config(1024, 64, 2, 4, 128, 0.0)).parameters()]
    z = zero3_gathered(numels, 2, max(numels), param_persistence_threshold=threshold)
    # from the second step (the trace recorded) every parameter is gathered after forward: the persistent
    # ones always, the rest kept for backward, as the model says
    assert later == [z["persistent"] + z["gathered"]] * 2 == [sum(numels)] * 2
    assert first < sum(numels)  # the first step releases them (no trace yet)
