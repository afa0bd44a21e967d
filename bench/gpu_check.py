"""`make gpu-check` / `python -m ptbench.gpu_check`: the one command a first GPU run needs. On the visible GPUs:
the one-GPU smoke, micro-checks (bench/gpu_micro.py), then a short bf16 run of gpt2_small and resnet50 per
installed adapter, as one table and a JSON-lines file (--out):

- status; step time mean, p50 and CV; tokens or images per second; the global batch (the same for every row);
- MFU by the formula (the workload's analytic FLOPs) and counted (torch's FlopCounterMode, the record's
  flops_check ratio);
- peak allocated, peak reserved and memory outside the allocator, beside the memory model's prediction, and
  the saved tensors counted (memory ledger) beside the model's;
- host-device synchronisations per timed step and their most frequent source lines (trainer.count_syncs).

Warm-up steps are excluded from the step statistics (trainer.untimed_steps); data is synthetic, so the table
measures the frameworks, not storage. The syncs are counted in the same runs (a wrapper per synchronising
call; no other instrument is on).

CUDA is required (one line naming a driver/CUDA mismatch otherwise); `--assert-cuda` only checks that (the GPU
CI's first step). `--cpu` runs the same cases at tiny sizes on the CPU (gpt2_tiny, resnet50_tiny, fp32), so
the test suite runs this command itself. Under CI=true a skipped adapter is a failure.

`--budget` (default 480 s: the whole command inside 8 minutes on one GPU) bounds the whole command, smoke,
micro-checks and cases: a row starts only while the time left covers what a row of its kind takes (its kind's
estimate, or 1.25 x the longest of its kind so far), runs under a timeout of at most the time left, and is
"not run (budget)" otherwise (a failure only under CI=true). Each row is printed and appended to
`<out>/gpu_check.jsonl` as it finishes, so a call cut short keeps every finished row; a second call with the same
`--out` keeps the rows that ran (ok, n/a, skipped) and runs the others. The launching process never initialises
CUDA (device names from NVML), so it holds no context on GPU 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ptbench.adapters import available, get_adapter_class
from ptbench.core.environments import cuda_error, cuda_error_line, nvidia_smi_versions  # noqa: F401
from ptbench.core.errors import ConfigError
from ptbench.core.records import nvml_gpus
from ptbench.run_point import run_bench
from ptbench.runner.compose import compose, typed, visible_gpus
from ptbench.runner.plan import make_plan
from ptbench.smoke import framework_installed, in_ci, run_one, smoke_point

KINDS = {"gpt2_small": "language", "resnet50": "vision", "gpt2_tiny": "language", "resnet50_tiny": "vision"}
GLOBAL_BATCH = 8
STEPS, UNTIMED = 12, 4
GPU = {"workloads": ("gpt2_small", "resnet50"), "precision": "bf16", "samples": 2048}
CPU = {"workloads": ("gpt2_tiny", "resnet50_tiny"), "precision": "fp32", "samples": 64}
CPU_STEPS, CPU_UNTIMED = 4, 2
NOT_RUN = "not run (budget)"


def common(cpu: bool) -> list[str]:
    size, steps, untimed = (CPU, CPU_STEPS, CPU_UNTIMED) if cpu else (GPU, STEPS, UNTIMED)
    return [
        "data=synthetic",
        f"trainer.precision={size['precision']}",
        "trainer.epochs=1",
        f"trainer.max_steps={steps}",
        f"trainer.untimed_steps={untimed}",
        "trainer.eval_every_epoch=false",
        f"data.train_samples={size['samples']}",
        "trainer.progress=false",
        "trainer.count_syncs=true",
    ]


def cuda_ok_line() -> str:
    """torch's build and the GPUs, named by NVML: this process never initialises CUDA (no context on GPU 0
    for the whole check, beside the ranks')."""
    import torch

    driver, driver_cuda = nvidia_smi_versions()
    gpus = [g["name"] for g in nvml_gpus().get("nvidia_smi_gpus", [])]
    return (
        f"cuda: torch {torch.__version__} built for CUDA {torch.version.cuda}, driver {driver} (CUDA {driver_cuda}), "
        f"{len(gpus)} GPU(s): {', '.join(dict.fromkeys(gpus)) or 'names unknown (no NVML)'}"
    )


# --- one case --------------------------------------------------------------------------------------------
def case_overrides(adapter: str, workload: str, devices: int, root: Path, cpu: bool) -> tuple[list[str] | None, str]:
    """The case's overrides at the global batch every row shares (None, why: it cannot run here)."""
    layout, why = smoke_point(adapter, devices, root)
    if layout is None:
        return None, why
    keep = [o for o in layout if o.startswith(("launcher.", "adapter."))]
    overrides = [f"adapter={adapter}", f"workload={workload}", *common(cpu), *keep]  # run_bench names the root
    batch = GLOBAL_BATCH
    for _ in range(2):  # the layout's samples per step at this per-device batch, then the batch that gives 8
        try:
            plan = make_plan(
                typed(compose([*overrides, f"trainer.batch_size={batch}", f"results.root={root}"])), "local"
            )
        except ConfigError as e:
            return None, str(e)
        if plan.global_batch == GLOBAL_BATCH:
            return [*overrides, f"trainer.batch_size={batch}"], ""
        batch = batch * GLOBAL_BATCH // plan.global_batch
        if batch < 1:
            break
    return None, f"its layout cannot step {GLOBAL_BATCH} samples at once (global batch {plan.global_batch})"


def run_case(adapter: str, workload: str, devices: int, root: Path, timeout: float, cpu: bool) -> dict:
    row = {"adapter": adapter, "workload": workload, "status": "ok"}
    cls = get_adapter_class(adapter)
    if KINDS[workload] not in cls.kinds:
        return {**row, "status": "n/a", "reason": f"adapter supports {', '.join(cls.kinds)}"}
    if not framework_installed(cls):
        return ci_skip({**row, "status": "skipped", "reason": f"{cls.framework} not installed"})
    overrides, why = case_overrides(adapter, workload, devices, root, cpu)
    if overrides is None:
        return ci_skip({**row, "status": "skipped", "reason": why})
    row["overrides"] = [o for o in overrides if o.startswith(("launcher.", "adapter.", "trainer.batch_size"))]
    run = run_bench(
        overrides, root=root, experiment="gpu-check", timeout=timeout, run_name=(adapter, workload, devices)
    )
    if not run.ok:
        return {**row, "status": "FAILED", "reason": f"{run.status}: {run.error_line}"}
    return {**row, **measured(run.summary, run.run_dir, KINDS[workload])}


def measured(s: dict, run_dir: Path, kind: str) -> dict:
    """The row's numbers from the run's record (summary.json and its last epoch event)."""
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines() if ln.strip()]
    epoch = [e for e in events if e.get("type") == "epoch"][-1]
    rank0 = epoch["ranks"][0]
    mem = rank0.get("memory") or {}
    syncs = rank0.get("host_syncs") or {}
    ratio = (s.get("flops_check") or {}).get("ratio")
    predicted = s.get("predicted_memory") or {}
    ledger = s.get("memory_ledger") or {}
    per_step = [e + i for e, i in zip(syncs.get("explicit_per_step", []), syncs.get("implicit_per_step", []))]
    return {
        "global_batch": s.get("global_batch"),
        "step_mean_ms": 1e3 * s["step_time_mean_s"],
        "step_p50_ms": 1e3 * epoch["step_time_p50_s"],
        "step_cv": epoch.get("step_time_cv"),
        "rate": s.get("tokens_per_s") if kind == "language" else s.get("samples_per_s"),
        "unit": "tok/s" if kind == "language" else "img/s",
        "mfu": s.get("mfu"),
        "mfu_counted": s["mfu"] * ratio if s.get("mfu") is not None and ratio else None,
        "peak_allocated": mem.get("peak_allocated"),
        "peak_reserved": mem.get("peak_reserved"),
        "outside_allocator": mem.get("outside_allocator"),
        "peak_rss_delta": mem.get("peak_rss_delta"),
        "predicted_total": predicted.get("total"),
        "saved_counted": ledger.get("counted_saved_bytes"),
        "saved_predicted": ledger.get("predicted_saved_bytes"),
        "syncs_per_step": statistics.median(per_step) if per_step else None,
        "syncs_explicit": syncs.get("explicit_per_step"),
        "syncs_implicit": syncs.get("implicit_per_step"),
        "sync_sites": syncs.get("sites"),
        "run_dir": str(run_dir),
    }


def ci_skip(row: dict) -> dict:
    """Under CI=true a skipped row is a failure."""
    if row["status"] == "skipped" and in_ci():
        return {**row, "status": "FAILED", "reason": f"{row['reason']} (CI=true: a skip is a failure)"}
    return row


class Budget:
    """The whole command's seconds: a row starts only while what is left covers what a row of its kind takes (its
    estimate, or 1.25 x the longest of its kind so far: a first row of a kind may take longer than guessed)."""

    def __init__(self, seconds: float, estimates: dict[str, float], started: float = 0.0):
        self.t0 = time.monotonic() - started
        self.seconds, self.estimates, self.longest = seconds, estimates, {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        """Seconds a row may still take: the end's table and the interpreter's exit keep END_S."""
        return self.seconds - END_S - self.elapsed()

    def need(self, kind: str) -> float:
        return max(self.estimates[kind], 1.25 * self.longest.get(kind, 0.0))

    def ran(self, kind: str, wall_s: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), wall_s)


def not_run(row: dict, budget: Budget) -> dict:
    why = f"{budget.left():.0f}s of --budget={budget.seconds:.0f}s left, a {row['kind']} row needs {budget.need(row['kind']):.0f}s"
    if in_ci():
        return {**row, "status": "FAILED", "reason": f"{NOT_RUN}: {why}"}
    return {**row, "status": NOT_RUN, "reason": why}


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc; 0 elsewhere): the budget counts the imports too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


# --- micro-checks ----------------------------------------------------------------------------------------
MICRO = (  # (label, gpu_micro arguments, CUDA_DEVICE_MAX_CONNECTIONS at the process start)
    ("cdmc not set", ["cdmc"], None),
    ("cdmc set before start", ["cdmc"], "1"),
    ("cdmc set late", ["cdmc", "--late"], None),
    ("loss peak", ["loss"], None),
    ("lm_head V", ["lm_head"], None),
    ("resnet50 layouts", ["resnet"], None),
    ("StepPeak profiler", ["steppeak"], None),
)


def micro_check(label: str, args: list[str], cdmc: str | None, cpu: bool, timeout: float) -> dict:
    """One micro-check in a process of its own (CUDA_DEVICE_MAX_CONNECTIONS as it must be at that process's start)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if cdmc is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc
    cmd = [sys.executable, "-m", "ptbench.gpu_micro", *args, *(["--cpu"] if cpu else [])]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        result = json.loads(last) if p.returncode == 0 and last.startswith("{") else {"error": _tail(p.stderr)}
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {timeout:.0f}s"}
    if result.get("check") == "loss":
        result["model_per_NV"] = _model_loss_bytes_per_nv()
    return {"micro": label, **result}


def micro_checks(cpu: bool, timeout: float) -> list[dict]:
    return [micro_check(label, args, cdmc, cpu, timeout) for label, args, cdmc in MICRO]


def _model_loss_bytes_per_nv() -> float | None:
    """What the memory model charges GPT-2's CUDA loss path per N x V (None where it has no such figure)."""
    from ptbench.core import memory_model

    fn = getattr(memory_model, "loss_bytes_per_token_vocab", None)
    return fn("cuda") if fn else None


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def micro_line(r: dict) -> str:
    if "check" not in r and "error" not in r:  # not run
        return f"  {r['micro']}: {r['status']} ({r.get('reason', '')})"
    if "error" in r:
        return f"  {r['micro']}: FAILED {r['error']}"
    if r["check"] == "cdmc":
        seen = (
            "n/a on CPU"
            if r.get("ratio") is None
            else f"ratio {r['ratio']} ({'one queue' if r['one_queue'] else 'several queues'})"
        )
        return f"  {r['micro']}: started with {r['started_with']!r}, {seen}"
    if r["check"] == "loss":
        model = "-" if r.get("model_per_NV") is None else f"{r['model_per_NV']:g}"
        return f"  {r['micro']}: {r['per_NV']} bytes per N*V measured (N={r['N']}, V={r['V']}); the memory model charges {model}"
    if r["check"] == "steppeak":  # the trainer's timed steps follow StepPeak's step: `after` is what they pay
        return (
            f"  {r['micro']}: median step {r['ms_before']} ms before it ran, {r['ms_inside']} ms inside "
            f"(ratio {r['inside_ratio']}), {r['ms_after']} ms after it exited (ratio {r['after_ratio']}); "
            f"fastest steps' ratios {r['inside_ratio_min']} inside, {r['after_ratio_min']} after; {r['steps']} steps each"
        )
    if r["check"] == "lm_head":
        return f"  {r['micro']}: {r['ms_V50257']} ms at 50257, {r['ms_V50304']} ms at 50304 (ratio {r['ratio']})"
    times = ", ".join(f"{k[3:]} {v} ms" for k, v in r.items() if k.startswith("ms_"))
    return f"  {r['micro']} (batch {r['batch']}, {r['image']}px): {times}"


# --- the table -------------------------------------------------------------------------------------------
HEADER = [
    "adapter",
    "workload",
    "status",
    "batch",
    "step mean/p50",
    "cv",
    "throughput",
    "MFU f/c",
    "alloc/resv/outside",
    "predicted",
    "saved c/p",
    "syncs/step",
    "top sync site / reason",
]


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table_row(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [r["adapter"], r["workload"], r["status"], *[""] * 9, r.get("reason", "")[:90]]
    if r["peak_allocated"] is not None:
        mem = f"{_gib(r['peak_allocated'])}/{_gib(r['peak_reserved'])}/{_gib(r['outside_allocator'])} GiB"
    else:  # CPU: no allocator statistics; the process's resident growth over the epoch
        mem = f"rss+{_gib(r['peak_rss_delta'])} GiB"
    saved = (
        "-"
        if r["saved_counted"] is None
        else f"{r['saved_counted'] / 2**20:.0f}/{(r['saved_predicted'] or 0) / 2**20:.0f} MiB"
    )
    site = next(iter(r["sync_sites"] or {}), "")
    return [
        r["adapter"],
        r["workload"],
        "ok",
        str(r["global_batch"]),
        f"{r['step_mean_ms']:.1f}/{r['step_p50_ms']:.1f} ms",
        "-" if r["step_cv"] is None else f"{r['step_cv']:.3f}",
        f"{r['rate']:,.0f} {r['unit']}",
        f"{_pct(r['mfu'])}/{_pct(r['mfu_counted'])}",
        mem,
        f"{_gib(r['predicted_total'])} GiB",
        saved,
        "-" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:g}",
        f"{site} ({r['sync_sites'][site]}x)" if site else "",
    ]


def print_table(rows: list[dict], micro: list[dict], smoke: list[dict], devices: int, cpu: bool) -> None:
    size = CPU if cpu else GPU
    steps, untimed = (CPU_STEPS, CPU_UNTIMED) if cpu else (STEPS, UNTIMED)
    where = "CPU twin (tiny sizes; its numbers say nothing about a GPU)" if cpu else f"{devices} GPU(s)"
    print(
        f"\ngpu-check on {where}: {size['precision']}, synthetic data, global batch {GLOBAL_BATCH} for every row, "
        f"{steps} steps of which {untimed} warm-up excluded; syncs: median per timed step, rank 0"
    )
    cells = [HEADER, *map(table_row, rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
    if micro:
        print("micro-checks:")
        for m in micro:
            print(micro_line(m))
    for r in smoke:
        print(f"smoke {r['adapter']}: {r['status']} {r.get('reason', '')}".rstrip())


# --- the command -----------------------------------------------------------------------------------------
ESTIMATE_S = {  # what one row of each kind is taken to need before one has run (one H200: 20-35 s a run)
    "gpu": {"smoke": 40.0, "case": 45.0, "micro": 20.0},
    "cpu": {"smoke": 25.0, "case": 25.0, "micro": 10.0},
}
KEPT = ("ok", "n/a", "skipped")
END_S = 5.0  # kept back from the rows for the table and the interpreter's exit (torch's teardown: about 3 s)  # rows a second call into the same --out does not run again


def row_key(r: dict) -> str:
    return r["kind"] + ":" + (r["micro"] if r["kind"] == "micro" else f"{r['adapter']}:{r['workload']}")


def tasks(args, devices: int, workloads: list[str], root: Path) -> list[tuple[dict, object]]:
    """(the row's name, the call that runs it with a timeout), in order: the smoke, the cases, the micro-checks."""
    adapters = args.adapters.split(",")
    smoke = [] if args.skip_smoke or args.smoke == "none" else (adapters if args.smoke == "all" else ["ddp"])
    out: list[tuple[dict, object]] = []
    for name in smoke:
        out.append(
            ({"kind": "smoke", "adapter": name, "workload": "smoke"}, lambda t, n=name: smoke_row(n, devices, root, t))
        )
    for adapter in adapters:
        for w in workloads:
            out.append(({"kind": "case", "adapter": adapter, "workload": w},
                        lambda t, a=adapter, w=w: run_case(a, w, devices, root, t, args.cpu)))  # fmt: skip
    for label, micro_args, cdmc in [] if args.skip_micro else MICRO:
        out.append(
            (
                {"kind": "micro", "micro": label},
                lambda t, m=(label, micro_args, cdmc): micro_check(*m, args.cpu, min(t, 120)),
            )
        )
    return out


def smoke_row(name: str, devices: int, root: Path, timeout: float) -> dict:
    status, detail = run_one(name, devices, root / "smoke", timeout)
    return {"adapter": name, "workload": "smoke", "status": status, "reason": detail}


def run_rows(todo, budget: Budget, out: Path, timeout: float, kept: dict[str, dict]) -> list[dict]:
    """Each row in turn, within the budget; printed and appended to `out` the moment it finishes."""
    rows = []
    for name, call in todo:
        key = row_key(name)
        if key in kept:
            r = {**kept[key], "kept": True}
        elif budget.left() < budget.need(name["kind"]):
            r = not_run(name, budget)
        else:
            t0 = time.monotonic()
            r = {**name, **call(min(timeout, budget.left()))}
            r["wall_s"] = round(time.monotonic() - t0, 1)
            budget.ran(name["kind"], r["wall_s"])
        r["at_s"] = round(budget.elapsed(), 1)
        if not r.get("kept"):
            with out.open("a") as f:  # appended: a cut call keeps what finished; a second call adds its own
                f.write(json.dumps(r, default=str) + "\n")
        rows.append(r)
        print(progress_line(r, budget), flush=True)
    return rows


def progress_line(r: dict, budget: Budget) -> str:
    head = f"[{r['at_s']:5.0f}s of {budget.seconds:.0f}s] {r['kind']:<5}"
    took = " (kept from an earlier call)" if r.get("kept") else (f" ({r['wall_s']:.0f}s)" if "wall_s" in r else "")
    if r["kind"] == "smoke" and not r.get("kept"):
        took = ""  # the smoke's own line gives its time
    if r["kind"] == "micro":
        return head + micro_line(r) + took
    if r["kind"] == "case" and r["status"] == "ok":
        cells = table_row(r)
        return (
            f"{head} {r['adapter']} {r['workload']}: ok  step {cells[4]}  {cells[6]}  MFU {cells[7]}  {cells[8]}{took}"
        )
    return f"{head} {r['adapter']} {r['workload']}: {r['status']} {r.get('reason', '')}".rstrip() + took


def earlier_rows(out: Path) -> dict[str, dict]:
    """The rows an earlier call into the same --out finished (the latest of each), that need no second run."""
    kept = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            if "kind" in r:
                done = "error" not in r if r["kind"] == "micro" else r.get("status") in KEPT
                if done:
                    kept[row_key(r)] = r
                else:
                    kept.pop(row_key(r), None)
    return kept


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    budget = Budget(args.budget, ESTIMATE_S["cpu" if args.cpu else "gpu"], started=process_age_s())
    if not args.cpu:
        error = cuda_error()
        if error:
            print(f"{error} (on a CPU machine use make smoke, or --cpu for this check's CPU twin)", file=sys.stderr)
            return 2
        print(cuda_ok_line(), flush=True)
        if args.assert_cuda:
            return 0
    devices = 1 if args.cpu else visible_gpus()
    workloads = args.workloads.split(",") if args.workloads else list((CPU if args.cpu else GPU)["workloads"])
    unknown = [w for w in workloads if w not in KINDS]
    if unknown:
        print(f"error: --workloads {','.join(unknown)}: not one of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    root = args.out or Path("results") / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    out = root / "gpu_check.jsonl"
    print(f"gpu-check: rows into {out} as they finish; --budget {args.budget:.0f}s for the whole command", flush=True)
    rows = run_rows(tasks(args, devices, workloads, root), budget, out, args.timeout, earlier_rows(out))
    by = {k: [r for r in rows if r["kind"] == k] for k in ("case", "micro", "smoke")}
    print_table(by["case"], by["micro"], by["smoke"], devices, args.cpu)
    failed = [r for r in rows if r.get("status") == "FAILED" or "error" in r]
    counts = {
        s: sum(r.get("status", "ok" if "error" not in r else "FAILED") == s for r in rows) for s in ("ok", NOT_RUN)
    }
    print(
        f"gpu-check: {len(rows)} rows in {budget.elapsed():.0f}s of --budget {args.budget:.0f}s: {counts['ok']} ok, "
        f"{len(failed)} failed, {counts[NOT_RUN]} not run (budget); rows: {out}; records: {root}/gpu-check/"
    )
    return 1 if failed else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ptbench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default=",".join(available()))
    p.add_argument("--workloads", default=None, help="default: gpt2_small,resnet50 (--cpu: their tiny variants)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run at most")
    p.add_argument(
        "--budget", type=float, default=480, help="seconds for the whole command (smoke, cases, micro-checks)"
    )
    p.add_argument(
        "--smoke",
        choices=("ddp", "all", "none"),
        default="ddp",
        help="smoke rows: ddp's (default), every adapter's, none",
    )
    p.add_argument("--skip-smoke", action="store_true", help="as --smoke none")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--out", "--root", dest="out", type=Path, default=None,
                   help="folder for gpu_check.jsonl and the records (default: results/gpu-check-<time>/)")  # fmt: skip
    p.add_argument("--cpu", action="store_true", help="the same cases at tiny sizes on the CPU (one rank)")
    p.add_argument("--assert-cuda", action="store_true", help="only check that torch sees a GPU, in one line")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
