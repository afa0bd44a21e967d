"""The report's "At scale (dry run)" section: the records `python -m ptbench.scale` writes (status dry_run), each an
adapter's own code run as rank R of W on torch's fake process group, set beside the comm formula and the memory
model. They hold no time: the report keeps them out of every run table, figure and verdict and shows them here.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ptbench.analysis import records_io
from ptbench.analysis.load import find_runs
from ptbench.analysis.safe_io import md_text

DRY_RUN = "dry_run"


def dry_runs(root: str | Path) -> pd.DataFrame:
    """One row per dry-run record under `root`: adapter, workload, W, rank, the comm ratio (formula over ledger
    bytes per step), the memory category furthest from 1 (model over tracker) and the total's ratio."""
    rows = []
    for run_dir in find_runs(root):
        try:
            s = records_io.read_json(run_dir / "summary.json")
        except (OSError, ValueError):
            continue  # the run tables name an unreadable record
        if not isinstance(s, dict) or s.get("status") != DRY_RUN or not isinstance(s.get(DRY_RUN), dict):
            continue
        d = s[DRY_RUN]
        comm, memory = d.get("comm") or {}, d.get("memory") or {}
        total = ((memory.get("parts") or {}).get("total") or {}).get("ratio")
        rows.append(
            dict(
                adapter=s.get("adapter"),
                workload=s.get("workload"),
                W=s.get("world_size"),
                rank=d.get("rank"),
                comm_ratio=comm.get("ratio"),
                worst_memory=memory.get("worst_part"),
                worst_ratio=memory.get("worst"),
                total_memory_ratio=total,
                seconds=d.get("seconds"),
                cannot_check=d.get("cannot_check"),
            )
        )
    return pd.DataFrame(rows)


def at_scale_lines(root: str | Path | None) -> list[str]:
    """The section, or nothing when the folder holds no dry run."""
    table = dry_runs(root) if root is not None and Path(root).exists() else pd.DataFrame()
    if table.empty:
        return []
    shown = table.drop(columns=["cannot_check"]).sort_values(["workload", "adapter", "W", "rank"])
    for col in ("comm_ratio", "worst_ratio", "total_memory_ratio"):
        shown[col] = shown[col].map(lambda v: f"{v:.4f}" if isinstance(v, int | float) else "-")
    shown["seconds"] = shown["seconds"].map(lambda v: f"{v:.1f}" if isinstance(v, int | float) else "-")
    shown = shown.map(lambda v: md_text(str(v)))
    unchecked = next((c for c in table["cannot_check"] if isinstance(c, str) and c), None)
    return [
        "## At scale (dry run)",
        "",
        f"{len(table)} dry run(s) of `python -m ptbench.scale`: each adapter's own code as rank `rank` of `W` on "
        "torch's fake process group, its collectives against the comm formula (`comm_ratio`: formula over ledger "
        "bytes per step) and its memory against the memory model (model over torch's tracker; `worst_memory`: the "
        "category furthest from 1). No time: these records are in no table, figure or verdict above. "
        + (md_text(unchecked[0].upper() + unchecked[1:]) + "." if unchecked else ""),
        "",
        shown.to_markdown(index=False, tablefmt="pipe", disable_numparse=True, stralign="left"),
        "",
    ]
