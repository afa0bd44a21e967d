"""The report's "Predicted vs measured" section: what `python -m ptbench.predict` wrote into the results folder
(predictions.jsonl: one line per predicted point, its mode leave_one_out, validate or target)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd

from ptbench.analysis import records_io
from ptbench.analysis.safe_io import md_text
from ptbench.core.readers import predictions

PREDICTIONS = "predictions.jsonl"
MODES = {
    "validate": "held out (`python -m ptbench.predict validate`)",
    "leave_one_out": "leave-one-out (`python -m ptbench.predict RESULTS_DIR`)",
    "target": "targets not measured (`--target`)",
}


def read_predictions(results_dir: str | Path) -> pd.DataFrame:
    rows = predictions(Path(results_dir) / PREDICTIONS)  # a line that is not a JSON object is left out
    return pd.DataFrame([row for row in rows if row.get("predicted_step_s") is not None])


def _table(df: pd.DataFrame) -> str:
    def ms(v):
        return "-" if v is None or pd.isna(v) else f"{v * 1e3:.1f}"

    out = pd.DataFrame(
        {
            "series": df["series"].map(md_text),  # text from a file in the results folder: data, not markup
            "ranks": df["world_size"],
            "micro-batches": df["microbatches"],
            "link (Mbit/s)": df["link_mbit"].map(lambda v: "-" if v is None or pd.isna(v) else f"{v:g}"),
            "predicted step (ms)": df["predicted_step_s"].map(ms),
            "interval (ms)": df["interval_s"].map(lambda iv: f"{iv[0] * 1e3:.1f}-{iv[1] * 1e3:.1f}"),
            "measured (ms)": df["measured_step_s"].map(ms),
            "err %": df["err_pct"].map(lambda v: "-" if v is None or pd.isna(v) else f"{v:+.1f}"),
            "noise %": df["noise_pct"].map(lambda v: "-" if v is None or pd.isna(v) else f"{v:.1f}"),
            "memory model (MiB/rank)": df["memory_bytes_per_rank"].map(
                lambda v: "-" if v is None or pd.isna(v) else f"{v / 2**20:.1f}"
            ),
        }
    )
    return out.to_markdown(index=False, tablefmt="pipe", disable_numparse=True, stralign="left")


def predicted_lines(results_dir: str | Path) -> list[str]:
    """The section's lines; none when the folder holds no predictions (or none that can be read: said in one
    line, the rest of the report goes on)."""
    df = read_predictions(results_dir)
    if df.empty:
        return []
    try:
        return _lines(df)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        records_io.skipped(Path(results_dir) / PREDICTIONS, f"cannot be read ({type(e).__name__}: {e})")
        return []


def _lines(df: pd.DataFrame) -> list[str]:
    lines = [
        "## Predicted vs measured",
        "",
        "Step time predicted by `python -m ptbench.predict` from the measured parts (compute, collective bytes, "
        "alpha-beta fitted on `ptbench.comm`, the exposed factor and the pipeline bubble); err = predicted / "
        "measured - 1; noise = the repeats' half range.",
        "",
    ]
    for mode, title in MODES.items():
        sub = df[df["mode"] == mode]
        if sub.empty:
            continue
        lines += [f"### {title}", "", _table(sub), ""]
        errs = [abs(v) for v in sub["err_pct"] if v is not None and not pd.isna(v)]
        if errs:
            lines += [
                f"median |err| {statistics.median(errs):.1f} %, max {max(errs):.1f} % over {len(errs)} points",
                "",
            ]
    return lines
