"""The record schema (bench/core/schema.py) against the record's writers and readers.

Writers: every key real runs write (the shared smoke run; a run stopped with a checkpoint and resumed)
is in the schema, nested keys included, and the record writer refuses a key that is not. Readers:
every record key that analysis/, core/sinks.py, the memory study (studies/memory_study*.py, memory_points.py)
and runner/console.py read (string subscripts, `.get("...")`, `"..." in`, column lists, found in their syntax
trees) is in the schema or is a column those files make themselves; the test does this reading, so analysis
still imports nothing of the runner. results/README.md's field table is the schema's. Each check is also fed a
misspelt key, to show that it fails.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ptbench.core import schema
from ptbench.core.records import RunRecord, RunWriter
from tests.helpers import bench, check_ok, events, only_run, summary

REPO = Path(__file__).resolve().parents[1]
READERS = sorted((REPO / "analysis").rglob("*.py")) + [
    REPO / p
    for p in (
        "bench/core/sinks.py",
        "bench/studies/memory_study.py",
        "bench/studies/memory_points.py",
        "bench/studies/memory_study_ds.py",
        "bench/runner/console.py",
        "bench/predict/points.py",
    )
]
KEY = re.compile(r"^[a-z][a-z0-9_]*$")  # record keys are snake_case; "MLLOG" names, "comm MB/step" labels are not
# read by those files but no run record's: the `python -m ptbench.comm` report (bench/comm.py) that analysis
# joins to the records, the predictions.jsonl that `python -m ptbench.predict` writes (bench/predict/table.py),
# names of the analysis's own request arguments, and a multiprocessing start method
NOT_RECORD = {
    "wrong",  # a comm report's data check
    "bus_bytes",  # per collective kind inside profile.ranks[].by_kind, whose keys are the kinds
    "predicted_step_s",
    "measured_step_s",
    "err_pct",
    "noise_pct",
    "link_mbit",
    "memory_bytes_per_rank",
    "fork",
    "tool",
    "results",
    "op",
    "bytes",
    "busbw_gbps",
    "busbw_GBps",
    "message_bytes",
    "group_size",
    "formula",
    "name",
    "key",
    "value",
    "metadata",
    "time_ms",
    "event_type",
    # keys inside env.json's open `system` field (torch.utils.collect_env's probes, listed in its meaning)
    "cuda_runtime",
    "nvidia_driver",
}


def unknown_keys(run_dir: Path) -> list[str]:
    bad = [f"summary.json: {k}" for k in schema.unknown(summary(run_dir), schema.SUMMARY)]
    bad += [f"events.jsonl: {k}" for e in events(run_dir) for k in schema.unknown(e, schema.EPOCH_EVENT)]
    env = json.loads((run_dir / "env.json").read_text())
    return bad + [f"env.json: {k}" for k in schema.unknown(env, schema.ENV)]


def test_every_key_the_smoke_run_writes_is_in_the_schema(smoke_run):
    assert unknown_keys(smoke_run) == []
    # and the check finds a renamed key, at the top and nested
    s = summary(smoke_run)
    s["epoch_time_stedy_s"] = s.pop("epoch_time_steady_s")
    e = events(smoke_run)[0]
    e["ranks"][0]["memory"]["peak_rss_delt"] = e["ranks"][0]["memory"].pop("peak_rss_delta")
    assert schema.unknown(s) == ["epoch_time_stedy_s"]
    assert schema.unknown(e, schema.EPOCH_EVENT) == ["ranks[].memory.peak_rss_delt"]


def test_every_key_of_a_stopped_and_resumed_run_is_in_the_schema(tmp_path):
    """The keys only checkpoints and restarts write: checkpoint.saved, resumed_from, stop_signal, resumed."""
    command = [
        "experiment=smoke",
        "workload.vocab_size=256",
        "data.train_samples=32",
        "trainer.max_steps=0",
        "trainer.stop_check_every=1",
        "trainer.progress=false",
        "trainer.resume=auto",
        "trainer.checkpoint_every=1",
        "trainer.inject_stop=0:2",
    ]
    check_ok(bench(*command, results=tmp_path))
    assert summary(only_run(tmp_path))["status"] == "preempted"
    check_ok(bench(*command, results=tmp_path))
    run_dir = only_run(tmp_path)
    s = summary(run_dir)
    assert s["status"] == "ok" and s["resumed_from"] and s["checkpoint"]["saved"] and events(run_dir)[0]["resumed"]
    assert unknown_keys(run_dir) == []


def test_the_writer_refuses_a_key_not_in_the_schema(tmp_path):
    writer = RunWriter(tmp_path / "run", {"experiment": "x", "adapter": "ddp"})
    writer.start("{}\n")
    with pytest.raises(schema.SchemaError, match="'epoch_time_stedy_s' is not in ptbench/core/schema.py"):
        writer.finish({"status": "ok", "epoch_time_stedy_s": 1.0})
    with pytest.raises(schema.SchemaError, match="events.jsonl key 'sample_per_s'"):
        RunRecord(tmp_path / "run").append_event({"type": "epoch", "epoch": 0, "sample_per_s": 3.0})
    assert RunRecord(tmp_path / "run").summary()["status"] == "running"  # nothing half written


# --- readers ---------------------------------------------------------------------------------------
def _has_constant(node: ast.AST, value: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == value for n in ast.walk(node))


def _pattern(node: ast.JoinedStr) -> str | None:
    """f"dev_state_{part}" -> a regex of the keys it makes; None when it has too little text to tell."""
    parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values]
    text = sum(len(v.value) for v in node.values if isinstance(v, ast.Constant))
    return "".join(parts) if text >= 3 else None


def reads_and_makes(source: str) -> tuple[list[tuple[int, str]], set[str]]:
    """(line, key) of every string key `source` reads, and the keys it makes itself (assigned columns,
    dict keys, keyword names, dict values naming columns; f-string keys as regex patterns "re:..."). A key
    assigned from a read of the same key (`x=summary.get("x")`, `df["x"] = df["x"].map(...)`) is not made
    here: it still has to be a record key."""
    reads, makes = [], set()
    for n in ast.walk(ast.parse(source)):
        made_by_fstring = [
            t.slice
            for t in (n.targets if isinstance(n, ast.Assign) else [])
            if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.JoinedStr)
        ]
        keys = n.keys if isinstance(n, ast.Dict) else [n.key] if isinstance(n, ast.DictComp) else []
        made_by_fstring += [k for k in keys if isinstance(k, ast.JoinedStr)]
        makes |= {f"re:{p}" for p in map(_pattern, made_by_fstring) if p}
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            if isinstance(n.ctx, ast.Load):
                reads.append((n.lineno, n.slice.value))
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.List):  # df[["a", "b"]]
            reads += [
                (n.lineno, e.value) for e in n.slice.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "get"
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
        ):
            reads.append((n.lineno, n.args[0].value))
        elif (
            isinstance(n, ast.Compare)
            and isinstance(n.left, ast.Constant)
            and isinstance(n.left.value, str)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops)
        ):
            reads.append((n.lineno, n.left.value))
        if isinstance(n, ast.Assign):
            targets = [e for t in n.targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for t in targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.slice, ast.Constant)
                    and isinstance(t.slice.value, str)
                    and not _has_constant(n.value, t.slice.value)
                ):
                    makes.add(t.slice.value)
        elif isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and not _has_constant(v, k.value):
                    makes.add(k.value)
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    makes.add(v.value)  # {"config.path": "column"}, rename(columns={...})
        elif isinstance(n, ast.keyword) and n.arg and not _has_constant(n.value, n.arg):
            makes.add(n.arg)
    return [(line, k) for line, k in reads if KEY.match(k)], makes


def unexplained_reads(sources: dict[str, str]) -> list[str]:
    parsed = {name: reads_and_makes(text) for name, text in sources.items()}
    made = set().union(*(m for _, m in parsed.values()))
    allowed = schema.names() | made | NOT_RECORD
    patterns = [re.compile(m[3:]) for m in made if m.startswith("re:")]
    return [
        f"{name}:{line} reads {key!r}"
        for name, (reads, _) in parsed.items()
        for line, key in reads
        if key not in allowed and not any(p.fullmatch(key) for p in patterns)
    ]


def test_every_key_analysis_and_the_sinks_read_is_in_the_schema():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in READERS}
    assert len(sources) >= 5 and "analysis/load.py" in sources
    bad = unexplained_reads(sources)
    assert not bad, (
        "these reads name no record field of ptbench/core/schema.py and no column the readers make "
        "themselves; fix the name or add the field to the schema:\n" + "\n".join(bad)
    )


def test_a_misspelt_read_is_found():
    ok = 'def f(summary, df):\n    df["speedup"] = 1\n    return summary.get("epoch_time_steady_s"), df["speedup"]\n'
    assert unexplained_reads({"a.py": ok}) == []
    for bad in (
        'summary.get("epoch_time_stedy_s")',
        'df["sample_per_s"]',
        'df[["devices", "epoch_tim_s"]]',
        '"val_acuracy" in row',
        'out(x=summary.get("x_renamed"))',
    ):
        assert len(unexplained_reads({"a.py": f"def f(summary, df, row):\n    return {bad}\n"})) == 1, bad


# --- the schema's own consistency ------------------------------------------------------------------
def test_the_readme_table_is_the_schema():
    text = (REPO / "results" / "README.md").read_text()
    block = schema.readme_block(text)
    assert block is not None, "results/README.md lost its schema markers"
    assert block == schema.markdown().strip("\n"), (
        "results/README.md's field table differs from ptbench/core/schema.py: run "
        "`python -m ptbench.core.schema results/README.md`"
    )
    assert "| `epoch_time_steady_s` | s |" in block and "| `layout.tp` | count |" in block


def test_the_schema_follows_the_code_it_describes():
    from ptbench.core.timing import PHASES

    assert schema.PHASES == PHASES
    for fields in schema.FILES.values():
        names = [f.name for f in fields]
        assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    try:
        from ptbench.core.layout import Layout
    except ImportError:  # the layout object came in the same pass as this check: skip until it is there
        pytest.skip("no ptbench.core.layout yet")
    assert set(Layout(world_size=2, dp=2).as_dict()) == {f.name for f in schema.LAYOUT}
