"""adapter=pipeline under python -m ptbench.scale, and the static stage shapes that make it run there.

torch.distributed.pipelining infers each stage's input and output shapes at the first step with real sends, which
a fake process group does not deliver; the adapter now gives every PipelineStage its shapes (`stage_shapes`: one
micro-batch's forward of the whole model under FakeTensorMode). Here: the dry run's ledger holds the sends, receives
and all-reduces a 1F1B step implies, on the first and on the last rank; and on real gloo ranks the static shapes
equal what torch infers, with the same losses, for GPT-2 in fp32 and bf16 and a channels_last VGG.
"""

from __future__ import annotations

import os

import pytest
import torch

# gpt2_tiny: embed | block_0 | block_1 | head on 4 pipeline ranks; 3 replicas, so the three all-reduce groups differ
# in size: DDP over the replicas (3), the tied embedding's first and last stage (2), the clip's norm over pp (4)
PP, DP, M, SEQ, VOCAB, H = 4, 3, 4, 16, 512, 128
DRY = [
    "adapter=pipeline",
    f"adapter.pipeline_parallel={PP}",
    f"adapter.microbatches={M}",
    "adapter.batch_policy=per_device",
    "workload=gpt2_tiny",
    f"workload.seq_len={SEQ}",
    f"workload.vocab_size={VOCAB}",
    "trainer.batch_size=4",
    "trainer.grad_clip=1.0",
]
ACT = 1 * SEQ * H * 4  # one micro-batch's b x s x h activation (or its gradient), fp32


@pytest.fixture(scope="module", params=["first", "last"])
def point(request):
    from ptbench.scale.point import measure_point

    rank = 0 if request.param == "first" else PP * DP - 1
    return measure_point(DRY, PP * DP, rank)


def test_dry_run_ledger_has_the_schedules_sends_and_all_reduces(point):
    rows = {(r["op"], r["group_size"]): r for r in point["ledger"][-1]}
    assert point["ledger"][0] == point["ledger"][1]  # both steps move the same
    # per micro-batch the first stage sends its output and receives its gradient; the last the reverse
    assert rows[("send_recv", PP)]["count"] == M and rows[("send_recv", PP)]["buffer_bytes"] == M * ACT
    assert rows[("recv", PP)]["count"] == M and rows[("recv", PP)]["buffer_bytes"] == M * ACT
    # once per step: DDP's one bucket over the replicas, the tied wte gradient, the clip's squared norm
    assert rows[("all_reduce", DP)]["count"] == 1
    assert rows[("all_reduce", 2)]["count"] == 1 and rows[("all_reduce", 2)]["buffer_bytes"] == VOCAB * H * 4
    assert rows[("all_reduce", PP)]["count"] == 1 and rows[("all_reduce", PP)]["buffer_bytes"] == 4
    assert set(rows) == {("send_recv", PP), ("recv", PP), ("all_reduce", DP), ("all_reduce", 2), ("all_reduce", PP)}
    # the DDP bucket carries this stage's gradients once (the embedding's or the head's copy of wte among them)
    assert rows[("all_reduce", DP)]["buffer_bytes"] == point["memory"]["parts"]["grads"]["tracker"]
    assert {"ddp_comm_hook", "device_mesh_real", "memtracker_microbatches"} <= set(point["standins"])


def test_comm_formula_counts_the_ranks_own_stage_sends(point):
    # the first stage sends only activations, the last only input gradients: the formula at this rank counts its
    # own stage's m sends (the busiest, inner stage's 2m would read 2.0), while the run record keeps the busiest
    assert point["comm"]["by_op"]["send_recv"] == dict(formula=M * ACT, ledger=M * ACT, count=M, ratio=1.0)
    names = {c["name"] for c in point["formula"]["collectives"] if c["op"] == "send_recv"}
    assert names == ({"pp_activation_send"} if point["rank"] == 0 else {"pp_gradient_send"})
    # DDP all-reduces this stage's own parameters (embed + block_0, or block_1 + head with its copy of wte), not
    # Psi/p; beside it the tied wte's all-reduce; the ledger's clip norm (4 bytes) is not in the formula
    dp = next(c for c in point["formula"]["collectives"] if c["name"] == "dp_grad_all_reduce")
    assert dp["message_bytes"] == point["memory"]["parts"]["grads"]["tracker"]
    assert point["comm"]["by_op"]["all_reduce"]["ratio"] == pytest.approx(1.0, rel=1e-5)


def test_memtracker_standin_tracks_a_stage_run_once_per_micro_batch():
    """torch's MemTracker takes a top-level module's second forward for the next iteration and refuses it; a
    stage runs once per micro-batch of one step. With the stand-in it is tracked as a module used twice."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ptbench.scale.standins import _pipeline_standins

    stage, x = torch.nn.Linear(4, 4), torch.randn(2, 4)

    def step() -> dict:
        tracker = MemTracker()
        tracker.track_external(stage)
        with tracker:
            for _ in range(2):  # two micro-batches
                stage(x).sum().backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return {str(getattr(k, "value", k)): v for k, v in peak.items()}

    with pytest.raises(NotImplementedError, match="multiple iterative calls"):
        step()
    used: set[str] = set()
    with _pipeline_standins(used):
        peak = step()
    assert used == {"memtracker_microbatches"}
    assert peak["Parameter"] == peak["Gradient"] == (16 + 4) * 4


# --- real ranks: the static shapes are torch's own, and the losses do not move --------------------------------
CASES = {
    "gpt2_fp32": ["workload=gpt2_tiny", "workload.seq_len=16", "workload.vocab_size=512"],
    "gpt2_bf16": ["workload=gpt2_tiny", "workload.seq_len=16", "workload.vocab_size=512", "trainer.precision=bf16"],
    "vgg_channels_last": ["workload=vgg16_tiny", "workload.dropout=0", "workload.channels_last=true"],
}
COMMON = ["adapter=pipeline", "adapter.microbatches=2", "trainer.batch_size=4", "trainer.grad_clip=0.5"]
STEPS = 3


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """Each case twice on the same gloo group: static shapes (the adapter) and torch's inference (InferredShapes);
    writes the last stage's losses and every stage's shapes as the schedule holds them after the steps."""
    import torch.distributed as dist

    from ptbench.adapters.pipeline import PipelineAdapter
    from ptbench.core.dist import DistContext
    from ptbench.core.timing import PhaseTimer
    from ptbench.runner.compose import compose, typed
    from ptbench.workloads import build_workload

    class InferredShapes(PipelineAdapter):
        """The adapter as it was: no static shapes, so each stage infers them at the first step."""

        def stage_shapes(self, micro_batch):
            return None

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for case, overrides in CASES.items():
        for path, cls in (("static", PipelineAdapter), ("inferred", InferredShapes)):
            cfg = typed(compose([*COMMON, *overrides, f"launcher.nprocs={world}"]))
            cls.validate(cfg, world)
            workload = build_workload(cfg.workload, cfg.data)
            torch.manual_seed(0)
            ad = cls(cfg, workload, DistContext(rank=rank, world_size=world))
            ad.setup()
            rng = torch.random.get_rng_state()  # the shapes drew no random number (nor does torch's inference here)
            ad.train()
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(STEPS):
                loss = ad.train_step([_batch(workload, g)], PhaseTimer(cuda_sync=False))
                losses.append(None if loss is None else loss.item())
            meta = ad.schedule._stage._stage_meta
            results[(case, path)] = dict(losses=losses, inputs=repr(meta.inputs), outputs=repr(meta.outputs), rng=rng)
            ad.close()
            dist.barrier()
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _batch(workload, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """4 samples shaped as the workload's: random token ids (vocabulary 512), or random images and classes."""
    x, y = workload.example_batch(4, "cpu")
    if x.dtype == torch.int64:
        return torch.randint(0, 512, x.shape, generator=g), torch.randint(0, 512, y.shape, generator=g)
    return torch.randn(x.shape, generator=g), torch.randint(0, 10, y.shape, generator=g)


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    out = tmp_path_factory.mktemp("pipeline_shapes")
    mp.start_processes(_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_static_shapes_are_torchs_own_and_leave_the_losses_unchanged(gloo, case):
    for rank in (0, 1):
        static, inferred = gloo[rank][(case, "static")], gloo[rank][(case, "inferred")]
        assert static["inputs"] == inferred["inputs"], (rank, static["inputs"], inferred["inputs"])
        assert static["outputs"] == inferred["outputs"], (rank, static["outputs"], inferred["outputs"])
        assert torch.equal(static["rng"], inferred["rng"]), rank
        # every stage's output, and the input of the stage after the first, carry gradients
        assert "requires_grad=True" in static["outputs"] and ("requires_grad=True" in static["inputs"]) == (rank == 1)
    if case == "gpt2_bf16":  # autocast reaches the shapes: the head's logits are bf16
        assert "dtype=torch.bfloat16" in gloo[1][(case, "static")]["outputs"]
    static, inferred = gloo[1][(case, "static")]["losses"], gloo[1][(case, "inferred")]["losses"]
    assert len(static) == STEPS and all(x == x for x in static), static
    assert static == inferred  # bit for bit: the inference forward touches no parameter, buffer or random draw
