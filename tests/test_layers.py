"""Imports run one way: plumbing -> workloads -> adapters -> runner -> drivers; analysis reads records only, through
the records' own reader (ptbench.core.readers, a leaf: it imports nothing of ptbench).

Every import statement of every module is read (function-level, lazy imports included), so a
driver-only helper that an adapter imports "just inside a function" still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# repository folder -> the import name it installs as (pyproject.toml's package-dir)
FOLDERS = {
    "bench": "ptbench",
    "adapters": "ptbench.adapters",
    "workloads": "ptbench.workloads",
    "analysis": "ptbench.analysis",
}
LAYERS = {"plumbing": 0, "workloads": 1, "adapters": 2, "runner": 3, "drivers": 4}
# The one module of ptbench the analysis may import: the reader of results folders, which every command reads with
# too, so that the analysis and the commands refuse and skip the same files (test_the_record_reader_is_a_leaf).
RECORD_READER = "ptbench.core.readers"


def layer(module: str) -> str | None:
    """The layer of an importable module name of this project, None for anything else."""
    parts = module.split(".")
    if parts[0] == "hydra_plugins" and len(parts) > 1 and parts[1] == "ptbench_launcher":
        return "drivers"
    if parts[0] != "ptbench":
        return None
    if len(parts) == 1 or parts[1] == "core":
        return "plumbing"  # bench/__init__.py is a docstring
    if parts[1] in ("workloads", "adapters", "analysis"):
        return parts[1]
    return "runner" if parts[1] == "runner" else "drivers"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    if rel.parts[:3] == ("bench", "plugins", "hydra_plugins"):
        parts = list(rel.parts[2:])
    else:
        parts = [*FOLDERS[rel.parts[0]].split("."), *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, module: str, is_package: bool) -> list[tuple[int, list[str]]]:
    """(line, names) per import statement; `from bench import sweep` names bench and ptbench.sweep."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            out.append((node.lineno, [name, *(f"{name}.{a.name}" for a in node.names)]))
    return out


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    mine = layer(module)
    found = []
    for lineno, names in imported(source, module, is_package):
        for name in names:
            theirs = layer(name)
            if theirs is None or mine is None or theirs == mine:
                continue
            if mine == "analysis" and RECORD_READER in (name, name.rpartition(".")[0]):
                continue
            if mine == "analysis" or theirs == "analysis":
                found.append(f"{module}:{lineno} imports {name} ({mine} -> {theirs}: analysis reads records only)")
                break
            if LAYERS[theirs] > LAYERS[mine]:
                found.append(f"{module}:{lineno} imports {name} ({mine} -> {theirs}: upward)")
                break
    return found


def project_modules() -> list[Path]:
    return sorted(p for root in FOLDERS for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_imports_upward():
    found = []
    for path in project_modules():
        found += violations(module_name(path), path.read_text(), path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_no_module_imports_a_folder_by_its_bare_name():
    """Everything installs under ptbench: an `import adapters` (or bench, workloads, analysis) would
    reach another project's package of that name on the index, or nothing."""
    found = [
        f"{module_name(path)}:{lineno} imports {name}"
        for path in project_modules()
        for lineno, names in imported(path.read_text(), module_name(path), path.name == "__init__.py")
        for name in names[:1]
        if name.split(".")[0] in FOLDERS
    ]
    assert found == []


def test_every_module_has_a_layer():
    assert [m for m in map(module_name, project_modules()) if layer(m) is None] == []
    assert layer(module_name(REPO / "bench/plugins/hydra_plugins/ptbench_launcher/__init__.py")) == "drivers"


@pytest.mark.parametrize(
    "module, source",
    [
        (
            "ptbench.core.records",
            "def f():\n    from ptbench.workloads import build_workload\n",
        ),  # plumbing -> workloads, lazily
        ("ptbench.workloads.gpt2", "import ptbench.adapters.base\n"),
        ("ptbench.adapters.ddp", "from ptbench.runner.trainer import Trainer\n"),
        ("ptbench.adapters.zero", "from ptbench import sweep\n"),
        ("ptbench.runner.launch", "from ptbench.smoke import run_one\n"),
        ("ptbench.analysis.plots", "from ptbench.core.records import RunRecord\n"),
        ("ptbench.analysis.load", "from ptbench.core import readers\n"),  # the reader, but by its package
        ("ptbench.core.readers", "import ptbench.analysis.load\n"),
        ("ptbench.demo", "from ptbench.analysis.report import write_report\n"),
    ],
)
def test_the_check_catches_upward_imports(module, source):
    assert len(violations(module, source)) == 1


def test_the_check_allows_downward_imports():
    assert (
        violations(
            "ptbench.runner.launch", "from ptbench.adapters import get_adapter_class\nfrom ptbench.core import dist\n"
        )
        == []
    )
    assert (
        violations("ptbench.adapters.ddp", "from . import base\nfrom ptbench.adapters._pipeline import x\n", False)
        == []
    )


def test_the_analysis_may_import_the_record_reader_only():
    assert violations("ptbench.analysis.load", "from ptbench.core.readers import read_json, summaries\n") == []
    assert violations("ptbench.analysis.records_io", "import ptbench.core.readers as readers\n") == []
    assert len(violations("ptbench.analysis.load", "from ptbench.core.readers_extra import x\n")) == 1


def test_the_record_reader_is_a_leaf():
    """The analysis's one way into ptbench imports nothing of ptbench: through it the analysis reaches no more than
    the reading of records."""
    path = REPO / "bench" / "core" / "readers.py"
    names = {n for _, ns in imported(path.read_text(), RECORD_READER, False) for n in ns}
    assert {n for n in names if layer(n) is not None} == set()


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (lazy imports included), for every module in it."""
    modules = {module_name(p): p for p in project_modules() if module_name(p).startswith(package + ".")}
    graph = {}
    for name, path in modules.items():
        names = {n for _, ns in imported(path.read_text(), name, path.name == "__init__.py") for n in ns}
        graph[name] = {n for n in names if n in modules and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of `graph`, each once, as the path from its first module back to it."""
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circle = path[path.index(nxt) :]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    found.append([*circle, nxt])
            elif len(path) < len(graph):
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_no_import_cycle_inside_the_runner():
    """launch starts ranks, a rank never needs the launcher: the runner's modules import one way."""
    graph = import_graph("ptbench.runner")
    assert {"ptbench.runner.launch", "ptbench.runner.rank"} <= graph.keys()
    assert cycles(graph) == [], "\n".join(" -> ".join(c) for c in cycles(graph))


def test_the_cycle_check_catches_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    launch, rank = "ptbench.runner.launch", "ptbench.runner.rank"
    lazy = imported("def rank_main():\n    from ptbench.runner.launch import detect\n", rank, False)
    assert launch in {n for _, ns in lazy for n in ns}  # a lazy import is an edge too
    assert cycles({launch: {rank}, rank: {launch}}) == [[launch, rank, launch]]


def test_one_run_needs_no_other_command():
    """`python -m ptbench` takes point identity from the runner (bench/runner/points.py): it imports no
    other command (sweep, paper, smoke ...), so a change to a driver cannot break a single run."""
    main = REPO / "bench" / "__main__.py"
    names = {n for _, ns in imported(main.read_text(), "ptbench.__main__", False) for n in ns}
    assert {n for n in names if layer(n) == "drivers"} == set()
    assert {"ptbench.runner.points.apply_hydra_context", "ptbench.runner.points.skip_if_done"} <= names


MAX_LINES = 800  # a file a newcomer can read in one sitting


def test_no_product_file_is_over_800_lines():
    long = {
        str(p.relative_to(REPO)): n for p in project_modules() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these files below {MAX_LINES} lines: {long}"


def test_no_product_comment_names_an_issue():
    """Comments say why, not which issue: the issue tracker is not part of the product."""
    import re

    said = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
    found = [
        f"{p.relative_to(REPO)}:{i}"
        for p in project_modules()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if said.search(line)
    ]
    assert not found, f"say why, not which issue: {found}"
