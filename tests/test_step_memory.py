"""The optimizer step's peak (bench/core/memory_model/step.py `step_transient`) against what real optimizers, real
harness adapters and real DeepSpeed engines allocate on the CPU, counted with torch.profiler's memory events
(bench/core/memory.py `StepPeak`, which every run's trainer uses on the optimizer phase). Every expected byte
count is worked out by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from ptbench.core import memory_model as mm
from ptbench.core.memory import StepPeak
from ptbench.studies import memory_study as ms

SLACK = 64  # bytes: the optimizer's 4-byte step counters and scalars beside the temporaries


def _params(shapes):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


SHAPES = [(1000,), (300, 1000), (5000,), (200, 1000)]  # the two groups below: [1000, 300000] and [5000, 200000]


@pytest.mark.parametrize(
    "name, wd, expected",
    [
        # single-tensor AdamW: tensor i holds sqrt + quotient (8 n_i) while the previous denom (4 n_{i-1}) lives
        ("adamw", 0.1, max(4 * 1000 + 8 * 300_000, 4 * 5000 + 8 * 200_000)),  # 2,404,000
        # Adam's L2 decay adds grad.add(param) (4 n_i) in the decayed group only
        ("adam", 0.1, 4 * 1000 + 12 * 300_000),  # 3,604,000
        ("adam", 0.0, 4 * 1000 + 8 * 300_000),
        # SGD with momentum: grad.add(param) for weight decay, the buffer updated in place
        ("sgd", 0.1, 4 * 300_000),
        ("sgd", 0.0, 0),
    ],
)
def test_torch_optimizer_temporaries_on_cpu_match_the_profiler(name, wd, expected):
    ps = _params(SHAPES)
    groups = [{"params": ps[:2], "weight_decay": wd}, {"params": ps[2:], "weight_decay": 0.0}]
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    opt = cls(groups, lr=1e-3, **({"momentum": 0.9} if name == "sgd" else {}))
    opt.step()  # the state (moments, momentum buffers) is made at the first step: measure the second
    with StepPeak() as p:
        opt.step()
    assert expected <= p.peak <= expected + SLACK and abs(p.net) <= SLACK
    step_groups = [(SHAPES[:2], wd), (SHAPES[2:], 0.0)]
    pred = mm.predict(
        "none", params=sum(math.prod(s) for s in SHAPES), world_size=1, optimizer=name, device="cpu",
        weight_decay=wd, step_groups=step_groups,
    )  # fmt: skip
    assert pred["step_transient"] == pred["step_optimizer"] == expected
    # on CUDA torch steps foreach: 4 x the larger group (its _foreach_sqrt); SGD's weight-decay list likewise
    cuda = mm.predict("none", params=1, world_size=1, optimizer=name, weight_decay=wd, step_groups=step_groups)
    assert cuda["step_transient"] == (4 * 301_000 if (name != "sgd" or wd) else 0)


def test_implementation_by_device_and_the_harness_groups():
    assert mm.torch_step_impl("cuda")[0] == "foreach" and mm.torch_step_impl("cpu")[0] == "single_tensor"
    groups = mm.harness_step_groups([(10, 4), (4,), (3, 3)], 0.01)
    assert groups == [([(10, 4), (3, 3)], 0.01), ([(4,)], 0.0)]  # bench/core/optim.py param_groups' rule
    from ptbench.core.optim import param_groups  # the rule the optimizers really use, on real parameters

    real = param_groups([torch.nn.Parameter(torch.zeros(s)) for s in [(10, 4), (4,), (3, 3)]], 0.01)
    assert groups == [([tuple(p.shape) for p in g["params"]], g["weight_decay"]) for g in real]
    assert mm.optimizer_temporaries([([10, 20], 0.0)], "adamw", "fused") == (
        0.0,
        "0 (fused: no temporaries on the device)",
    )
    assert mm.optimizer_temporaries([([10, 20], 0.0)], "lamb", "single_tensor")[0] == 0  # timm's: not modelled
    # FSDP2's local shards (dim-0 chunks) and DeepSpeed's flat partitions per rank
    assert mm.rank_step_groups("fsdp", [([(5, 2)], 0.0)], 2, 1) == [([4], 0.0)]  # rows 3-4 of 5
    assert mm.rank_step_groups("zero2", [([(5, 2), (3,)], 0.0)], 2, 0) == [([7], 0.0)]
    assert mm.rank_step_groups("zero3", [([(5, 2), (3,)], 0.0)], 2, 0) == [([5 + 2], 0.0)]


G0 = 50257 * 128 + 32 * 128 + 2 * (128 * 384 + 128 * 128 + 2 * 128 * 512)  # gpt2_tiny (seq 32), >= 2 dims
PART = math.ceil(G0 / 2)  # 3,415,104: DeepSpeed's flat fp32 partition of that group at 2 ranks


@pytest.mark.parametrize(
    "variant, precision, extra, expected",
    [
        # DDP: single-tensor AdamW, the token embedding (first in its group) sets it: 8 x 50257 x 128
        ("ddp", "fp32", [], 8 * 50257 * 128),
        # FSDP2: rank 0's dim-0 chunk of the embedding, ceil(50257 / 2) = 25129 rows
        ("fsdp", "bf16", [], 8 * 25129 * 128),
        # ZeRO-2 / 3: the fp32 gradient partition (4) + AdamW's sqrt and quotient (8) on the flat partition
        ("zero2", "bf16", [], 12 * PART),
        ("zero3", "fp32", [], 12 * PART),
        # SGD without weight decay has no temporaries: the gradient norm's fp64 copy of the largest gradient
        # piece (rank 0: 3,415,104 elements of the embedding) and gloo's all-gather (4 B x the whole group) remain
        ("zero2", "fp32", ["optimizer=sgd", "optimizer.weight_decay=0"], 8 * PART),
        # stage 3: the fp64 norm of rank 0's piece of the embedding, ceil(50257 x 128 / 2) (under fp32 the flat
        # copy is the fp32 gradient itself: 4 x PART, no second copy; stage 3 has no all-gather in its step)
        ("zero3", "fp32", ["optimizer=sgd", "optimizer.weight_decay=0"], 8 * math.ceil(50257 * 128 / 2)),
    ],
)
def test_harness_adapters_step_peak_at_two_ranks(variant, precision, extra, expected):
    if variant.startswith("zero"):
        pytest.importorskip("deepspeed")
    r = ms.measure_step(variant, precision, 2, extra)
    measured = max(m["peak"] for m in r["measured"])
    assert r["predicted"]["step_transient"] == expected
    assert expected <= measured <= expected + SLACK, r["measured"]


def _ds_rank(rank: int, port: int, out: str) -> None:
    """A real DeepSpeed ZeRO-2 engine (bf16, CPU, gloo, 2 ranks) over 8 Linear(64, 64) weights stepped by
    SGD without momentum or weight decay: no optimizer temporaries; rank's measured step peak to out.RANK."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as adapters/zero.py: gloo does the work
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    for step in range(2):
        engine.backward(engine(x).float().pow(2).mean())
        if step == 0:
            engine.step()
            continue
        with StepPeak() as p:
            engine.step()
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(p.peak))
    dist.destroy_process_group()


def test_deepspeed_bf16_flat_copy_and_its_conversion(tmp_path):
    """Where nothing larger is alive, DeepSpeed's bf16 flat gradient copy (2 B) beside its fp32 conversion
    (4 B) sets the step's peak: 6 x the rank's 4 x 4096 = 16,384 elements = 98,304 bytes (the fp64 norm of a
    4096-element piece is 32,768, the fp32 gradient alone 65,536, gloo's bf16 all-gather 2 x 32,768)."""
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    pytest.importorskip("deepspeed")
    out = str(tmp_path / "peak")
    mp.spawn(_ds_rank, args=(free_port(), out), nprocs=2)
    measured = [int(open(f"{out}.{r}").read()) for r in range(2)]
    shapes = [(64, 64)] * 8
    pred = mm.predict(
        "zero2", params=8 * 4096, world_size=2, precision="bf16", optimizer="sgd", momentum=0.0, device="cpu",
        shapes=shapes, step_groups=[(shapes, 0.0)],
    )  # fmt: skip
    assert pred["step_transient"] == 6 * 16_384 == 98_304 and pred["step_optimizer"] == 0
    assert all(98_304 <= m <= 98_304 + SLACK for m in measured), measured


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--step", "--variants", "gpipe"],
            "error: --step measures ddp, fsdp, zero1, zero2, zero3; drop --variants gpipe",
        ),
        (["--step", "--timing"], "error: --step runs on its own"),
    ],
)
def test_step_flag_bad_input_is_one_line(capsys, argv, message):
    assert ms.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_no_step_peak_while_the_optimizer_state_is_made(smoke_run):
    """The smoke run has one untimed step: the first, where torch makes AdamW's moments (8 B per parameter), is
    no measure of the step's temporaries, so nothing is recorded for it (`-` in the report)."""
    from tests.helpers import events, summary

    s = summary(smoke_run)
    assert s["warmup_steps"] == 1
    ranks = [r for e in events(smoke_run) for r in e.get("ranks") or []]
    assert ranks and all(r["step_peak"] is None for r in ranks)
    assert s["memory_ledger"]["counted_saved_bytes"] and "counted_step_bytes" not in s["memory_ledger"]
