"""What a run prints: one line per epoch and a summary table at the end (rank 0 only)."""

from __future__ import annotations

import math


def fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_epoch(e: dict) -> None:
    metric = (
        f"val_acc {fmt(e.get('val_accuracy'), '.3f')}"
        if "val_accuracy" in e
        else f"val_ppl {fmt(e.get('val_perplexity'), '.2f')}"
    )
    print(
        f"epoch {e['epoch']}: {e['steps']} steps in {e['epoch_time_s']:.2f}s  "
        f"step {fmt(e['step_time_mean_s'], '.4f')}s  {fmt(e['samples_per_s'], '.1f')} samples/s  "
        f"loss {fmt(e['train_loss'], '.4f')}  val_loss {fmt(e.get('val_loss'), '.4f')}  {metric}",
        flush=True,
    )


def print_summary(s: dict) -> None:
    metric = (
        ("val_accuracy", s.get("val_accuracy"))
        if s.get("val_accuracy") is not None
        else ("val_perplexity", s.get("val_perplexity"))
    )
    rows = [
        ("status", s["status"]),
        ("run", s.get("run_id")),
        ("adapter x workload", f"{s.get('adapter')} x {s.get('workload')} on {s.get('world_size')} rank(s)"),
        ("global batch", s.get("global_batch")),
        ("epochs / steps", f"{s.get('epochs_completed')} / {s.get('steps')}"),
        ("step time (mean, after warm-up)", f"{fmt(s.get('step_time_mean_s'), '.4f')} s"),
        ("throughput", f"{fmt(s.get('samples_per_s'), '.1f')} samples/s, {fmt(s.get('tokens_per_s'), '.0f')} tokens/s"),
        ("epoch time (mean)", f"{fmt(s.get('epoch_time_mean_s'), '.2f')} s"),
        ("final train / val loss", f"{fmt(s.get('train_loss'), '.4f')} / {fmt(s.get('val_loss'), '.4f')}"),
        (metric[0], fmt(metric[1], ".4f")),
        ("peak memory per rank (max)", f"{fmt((s.get('peak_memory_max') or 0) / 2**20, '.0f')} MiB"),
    ]
    if s.get("compile"):
        c = s["compile"]
        rows.append(
            (
                "torch.compile",
                f"{c['backend']}: {fmt(c['time_s'], '.1f')} s compiling (in warm-up, out of step "
                f"stats), {c['frames']} frame(s), {c['timed_step_frames']} after warm-up",
            )
        )
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
