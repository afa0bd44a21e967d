"""`make smoke`: every installed adapter x its smallest workload for a few steps, one line each.

Runs on whatever device is there (one GPU on a GPU CI runner, CPU here). Exit code 1 if any
installed adapter fails; an adapter whose framework is not installed is listed as skipped.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adapters import available, get_adapter_class


def framework_installed(cls) -> bool:
    module = {"megatron-core": "megatron.core"}.get(cls.framework, cls.framework)
    return importlib.util.find_spec(module) is not None


def run_one(name: str, root: Path) -> tuple[str, str]:
    cls = get_adapter_class(name)
    if not framework_installed(cls):
        return "skipped", f"{cls.framework} not installed"
    cmd = [sys.executable, "-m", "bench", "experiment=smoke", f"adapter={name}", *cls.smoke_overrides,
           f"results.root={root}", f"results.experiment=smoke-{name}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summaries = list((root / f"smoke-{name}").rglob("summary.json"))
    s = json.loads(summaries[0].read_text()) if summaries else {}
    if proc.returncode != 0 or s.get("status") != "ok":
        err = s.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return "FAILED", f"{err} ({wall:.0f}s)"
    step = s.get("step_time_mean_s")
    return "ok", f"{s['workload']} x{s['world_size']}  step {step:.4f}s  loss {s.get('train_loss'):.3f}  ({wall:.0f}s)"


def main(argv: list[str]) -> int:
    names = argv or available()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        for name in names:
            status, detail = run_one(name, Path(tmp))
            failed += status == "FAILED"
            print(f"smoke {name:<16} {status:<8} {detail}", flush=True)
    print(f"smoke: {len(names) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
