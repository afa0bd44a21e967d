"""The memory studies' points: which variants they run, how a point runs, what it holds and should hold.

Shared by ptbench.studies.memory_study (the tables) and ptbench.studies.memory_study_ds (DeepSpeed's own
estimators beside the memory model), so that neither imports the other for them.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from ptbench.core.memory_model import numel, predict
from ptbench.run_point import run_bench
from ptbench.studies.tally import Tally
from ptbench.studies.variants import overrides as variant_row

# rows of ptbench.studies.variants: data parallel (the ZeRO paper's formulas cover them) ...
DATA_PARALLEL = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp")
# ... and those whose layout follows the rank count N (model parallel over all N ranks; horovod)
RANKED = ("tensor_parallel", "megatron", "pipeline", "gpipe", "horovod")
ALL_VARIANTS = [*DATA_PARALLEL, *RANKED]
# the row of ptbench.studies.variants a study label runs, where they differ: the memory study's zero3 shards every
# parameter, so that its bytes follow the Ψ/N formulas (variants.py says why)
ROW_OF = {"zero3": "zero3-all"}
MIB = 2**20


def ruled(head: str) -> list[str]:
    """A text table's first lines: its head (title lines, then the column names) and a rule as long as the names."""
    return [head, "-" * len(head.splitlines()[-1])]


def ok_record(s: dict | None, label: str, lines: list[str], cut: int | None = None) -> dict | None:
    """`s` when it is a finished point's record, else None: a point without a record is passed over, a failed one
    adds `label  status: error` (the error cut to `cut` characters) to the table's `lines`."""
    if s is None or s.get("status") == "ok":
        return s
    lines.append(f"{label}  {s.get('status')}: {str(s.get('error'))[:cut]}")
    return None


def variant_overrides(variant: str, ranks: int) -> list[str]:
    return variant_row(ROW_OF.get(variant, variant), ranks)


# the data-parallel variants' overrides (they do not depend on the rank count)
VARIANTS = {v: variant_overrides(v, 2) for v in DATA_PARALLEL}


# --- predictions: bench/core/memory_model/, the one memory model ---------------------------------------
@functools.cache
def sharding_of(variant: str) -> str:
    """How the variant's adapter splits the model states: its cost inputs (`Adapter.cost_inputs`)."""
    from ptbench.adapters import get_adapter_class
    from ptbench.runner.compose import compose, typed

    cfg = typed(compose(variant_overrides(variant, 2)))
    return get_adapter_class(cfg.adapter.name).cost_inputs(cfg).sharding


def paper_formula(variant: str, psi: int, n: int) -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank for fp32 Adam (the memory model's Ψ/N rule at its peak:
    ZeRO-1's full gradients during backward included); `master` is DeepSpeed's extra fp32 partition."""
    p = predict(sharding_of(variant), params=psi, world_size=n)
    return {"total": p["model_states"] - p["master"] + p["transient"], "master": p["master"]}


def workload_model(overrides: list[str], device: str = "meta"):
    """The workload's model of `overrides` (their workload / data keys), built on `device` (meta: shapes, no
    memory)."""
    import torch

    from ptbench.runner.compose import compose
    from ptbench.workloads import build_workload

    cfg = compose([o for o in overrides if o.split("=")[0].split(".")[0] in ("workload", "data")])
    workload = build_workload(cfg.workload, cfg.data)
    with torch.device(device):
        return workload.build_model()


def param_numels(overrides: list[str]) -> list[tuple[int, ...]]:
    """Shapes of the workload's unique parameters, in `model.parameters()` order (DeepSpeed's flat order)."""
    return [tuple(p.shape) for p in workload_model(overrides).parameters()]  # parameters() yields a tied tensor once


def expected_state(
    variant: str, shapes: list[tuple[int, ...]], n: int, rank: int, precision: str = "fp32"
) -> dict[str, int]:
    """Bytes rank `rank` of `n` should hold for Adam, from the tensor shapes and the partitioning rule of
    the memory model (`predict` with `shapes` and `rank`): {params, grads, optimizer (moments + master)}.

    DDP / ZeRO-0: everything whole. ZeRO-1/2: parameters whole; moments and the fp32 master for an equal
    1/N slice of the flat buffer; gradients, when the optimizer step begins, for every tensor overlapping
    that slice, whole. ZeRO-3: each tensor split into ceil(numel/N). FSDP2: each tensor split along dim 0
    in torch.chunk pieces; no master copy. bf16/fp16: DeepSpeed stages 1-3 hold 2-byte parameters and
    gradients; FSDP2's MixedPrecisionPolicy and DDP's autocast keep fp32 state."""
    if variant == "zero0" and precision != "fp32":
        raise ValueError("zero0 in half precision uses DeepSpeed's BF16/FP16 optimizer wrappers: not modelled")
    p = predict(
        sharding_of(variant),
        params=sum(numel(s) for s in shapes),
        world_size=n,
        shapes=shapes,
        rank=rank,
        precision=precision,
    )
    return {"params": p["params"], "grads": p["grads"], "optimizer": p["optimizer"] + p["master"]}


# --- running the points -----------------------------------------------------------------------------
def run_point(
    variant: str, ranks: int, overrides: list[str], root: Path, stamp: str, steps: int, warmup: int, timeout: int
) -> dict:
    run = run_bench(
        [
            *variant_overrides(variant, ranks),
            *overrides,
            f"launcher.nprocs={ranks}",
            f"trainer.max_steps={steps}",
            f"trainer.untimed_steps={warmup}",
            "trainer.epochs=1",
            "trainer.eval_every_epoch=false",
            "trainer.progress=false",
        ],
        root=root,
        experiment="memory_study",
        run_id=f"{stamp}-{variant}-w{ranks}",
        timeout=timeout,
    )
    summary = dict(run.summary) if run.ok else {"status": run.status, "error": run.error_line}
    summary["wall_s"] = run.wall_s
    if run.ok and run.run_dir is not None:
        summary["rss_delta_max"] = rss_delta_max(Path(run.run_dir))
    return summary


def rss_delta_max(run_dir: Path) -> float | None:
    """The busiest rank's peak_rss_delta in the last epoch of a record (CPU runs), else None."""
    import json

    path = run_dir / "events.jsonl"
    if not path.exists():
        return None
    epochs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    epochs = [e for e in epochs if e.get("type", "epoch") == "epoch"]
    if not epochs:
        return None
    vals = [(r.get("memory") or {}).get("peak_rss_delta") for r in epochs[-1].get("ranks") or []]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _state_total(s: dict) -> int:
    return sum(s.get(k) or 0 for k in ("params", "grads", "optimizer"))


def measured_states(summary: dict) -> dict | None:
    """Model-state bytes of the busiest rank (of the busiest device, for a rank that records per-device
    states: gpipe's partitions): {params, grads, optimizer, total}."""
    per_rank = summary.get("state_bytes_per_rank") or []
    entries = []
    for r in per_rank:
        devs = next((r[k] for k in ("per_device", "per_partition") if isinstance(r.get(k), list) and r[k]), None)
        entries += devs if devs else [r]
    if not entries:
        return None
    top = max(entries, key=_state_total)
    return {
        "params": top.get("params") or 0,
        "grads": top.get("grads") or 0,
        "optimizer": top.get("optimizer") or 0,
        "total": _state_total(top),
    }


def announce(tally: Tally, what: str, status: str, wall_s: float) -> None:
    """One line per finished run (stderr: the tables own stdout), with how far the command is."""
    n = tally.done + 1
    print(f"  [{n}/{tally.total}] {what}: {status} in {wall_s:.0f}s{tally.tick()}", file=sys.stderr, flush=True)


def start(total: int, what: str, where) -> Tally:
    print(f"memory_study: {total} runs ({what}), a line as each ends; records under {where}/", file=sys.stderr)
    return Tally(total)
