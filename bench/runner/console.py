"""What a run prints (rank 0 only): progress (a bar on a terminal, a line every trainer.log_every steps in a
batch log), one line per epoch and a summary table at the end."""

from __future__ import annotations

import math
import sys
import time


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
        (
            "throughput",
            f"{fmt(s.get('samples_per_s'), '.1f')} samples/s"
            + (f", {fmt(s['tokens_per_s'], '.0f')} tokens/s" if s.get("tokens_per_s") else ""),  # vision: no tokens
        ),
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


class Progress:
    """Progress through an epoch's steps or a validation pass, on rank 0.

    On a terminal (or with trainer.progress=true) a tqdm bar; otherwise, in a batch log, one line at the
    first step and every `every` steps (torchtitan's `log_freq` convention: trainer.log_every, 0 = none),
    so a slow run can be told from a hung one before its epoch ends. A line reads only host clocks: it
    never waits for the device (the step's loss stays where it is until the epoch ends)."""

    def __init__(self, total: int, desc: str, every: int, bar: bool, unit: str = "step"):
        self.total, self.desc, self.every, self.unit = total, desc, every, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.every > 0 and (self.done == 1 or self.done % self.every == 0 or self.done == self.total):
            self.line()

    def line(self) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else float("nan")
        left = (self.total - self.done) / rate if rate > 0 and self.total else float("nan")
        print(
            f"progress: {self.desc} {self.unit} {self.done}/{self.total}  {elapsed:.1f}s  "
            f"{fmt(rate, '.2f')} {self.unit}/s  eta {fmt(left, '.0f')}s",
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress(total: int, desc: str, rank: int, show: bool | None, every: int, unit: str = "step") -> Progress | None:
    """The rank-0 progress of `total` steps: a tqdm bar when `show` (trainer.progress; None = when stdout is
    a terminal), else log lines every `every` steps; None on other ranks, or with no bar and every=0."""
    if rank != 0:
        return None
    bar = sys.stdout.isatty() if show is None else show
    if not bar and every <= 0:
        return None
    return Progress(total, desc, every, bar, unit)
