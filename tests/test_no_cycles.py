"""No import circle anywhere in ptbench: every module of the project can be read, and tested, before the ones
it imports are understood in turn.

The graph is static (each file's syntax tree, nothing imported): every module of the project (bench/ as ptbench,
adapters/, workloads/, analysis/, the Hydra launcher plugin) with an arrow A -> B for every import statement of
A that names module B of the project. Module-level imports and imports inside functions both count: a lazy
import closes its circle the first time it runs, and a circle of lazy imports is still two modules that can
only be understood together. `import X.Y` is an arrow to X.Y alone, `from X import Y` to the submodule X.Y where
there is one, else to X's __init__: a package is always imported before its submodules, so that arrow is implied,
not drawn (tests/test_layers.py `imported` reads the statements, as for the layer check).
"""

from __future__ import annotations

from collections import deque

from tests.test_layers import imported, module_name, project_modules


def arrows(names: list[str], modules) -> set[str]:
    """The modules one import statement reaches (`imported`'s names: [X] for `import X`, [X, X.a, ...] for
    `from X import a, ...`). `from X import a` reaches the submodule X.a where there is one, and the package X
    itself only for a name its __init__ defines: a submodule's own package is always imported before it, so that
    arrow would close a circle for every package."""
    if len(names) == 1:
        return {names[0]} & set(modules)
    base, members = names[0], names[1:]
    found = {m for m in members if m in modules}
    return found | ({base} & set(modules) if len(found) < len(members) else set())


def graph_of(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, among `sources` ({module: (source,
    is it a package's __init__)})."""
    graph = {}
    for name, (source, is_package) in sources.items():
        graph[name] = {}
        for line, names in sorted(imported(source, name, is_package)):
            for target in sorted(arrows(names, sources) - {name}):
                graph[name].setdefault(target, line)
    return graph


def project_graph() -> dict[str, dict[str, int]]:
    return graph_of({module_name(p): (p.read_text(), p.name == "__init__.py") for p in project_modules()})


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm, iterative): each group's
    modules import each other through some circle. Sorted, each group sorted."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """The shortest circle from the group's first module back to it, inside the group (breadth first)."""
    start, members = group[0], set(group)
    came_from = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(set(graph[node]) & members):
            if nxt == start:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{group} is not a strongly connected group")


def describe(graph: dict) -> list[str]:
    """One line per tangle: its modules, and one circle through them, each arrow at its import's line where the
    graph knows it (`module:line -> imported`)."""
    out = []
    for g in tangles(graph):
        path = circle(graph, g)
        at = [f"{a}:{graph[a][b]}" if isinstance(graph[a], dict) else a for a, b in zip(path, path[1:])]
        out.append(f"{len(g)} modules {', '.join(g)}: {' -> '.join([*at, path[-1]])}")
    return out


def test_no_import_circle_in_ptbench():
    graph = project_graph()
    # the whole project, not one package: the spine, the studies, the adapters, the analysis, the launcher plugin
    assert {
        "ptbench.__main__",
        "ptbench.studies.memory_study",
        "ptbench.runner.rank",
        "ptbench.adapters.zero",
        "ptbench.analysis.report",
        "hydra_plugins.ptbench_launcher",
    } <= graph.keys()
    found = describe(graph)
    assert found == [], "import circles (A -> B: A imports B):\n" + "\n".join(found)


def test_the_check_names_a_circle_closed_by_a_lazy_import():
    sources = {
        "ptbench.studies.a": ("from ptbench.studies.b import run\n", False),
        "ptbench.studies.b": ("def run():\n    from ptbench.studies import a\n", False),
        "ptbench.studies": ("", True),
        "ptbench.core.c": ("import ptbench.studies.a\n", False),  # into the circle, not on it
    }
    graph = graph_of(sources)
    assert describe(graph) == [
        "2 modules ptbench.studies.a, ptbench.studies.b: ptbench.studies.a:1 -> ptbench.studies.b:2 -> ptbench.studies.a"
    ]
    sources["ptbench.studies.b"] = ("def run():\n    return 1\n", False)
    assert describe(graph_of(sources)) == []
    # a package's __init__ and a submodule that takes a sibling from it: no circle; a name of the __init__: one
    sources["ptbench.studies"] = ("def run():\n    from ptbench.studies import a\n", True)
    sources["ptbench.studies.a"] = ("from ptbench.studies import b\n", False)
    assert describe(graph_of(sources)) == []
    sources["ptbench.studies.a"] = ("from ptbench.studies import b, run\n", False)
    assert describe(graph_of(sources)) == [
        "2 modules ptbench.studies, ptbench.studies.a: ptbench.studies:2 -> ptbench.studies.a:1 -> ptbench.studies"
    ]


def test_the_check_finds_a_long_circle_in_a_large_graph():
    """Tarjan's groups stay linear in the arrows where listing every path would not end (a 300-module chain
    with shortcuts has more paths than can be walked)."""
    graph = {f"m{i:03d}": {f"m{i + 1:03d}", f"m{i + 2:03d}"} for i in range(298)}
    graph |= {"m298": {"m299"}, "m299": set()}
    assert describe(graph) == []
    graph["m299"] = {"m000"}
    (line,) = describe(graph)
    # all 300 in the group; the circle the shortest: 150 hops (by twos, one odd step) to m299, then home
    assert line.startswith("300 modules m000, m001") and line.endswith("-> m297 -> m299 -> m000")
    assert line.split(": ", 1)[1].count(" -> ") == 151
