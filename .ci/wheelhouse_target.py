"""`make wheelhouse TARGET_FREEZE=<file>`: a wheelhouse of only what the target lacks.

TARGET_FREEZE is the target's `pip freeze` (name==version, name @ url, -e lines) or a list of names, one a
line. Two steps, standard library only (it runs under the Makefile's venv python):

  constraints CONSTRAINTS FREEZE   print the resolve's constraints: constraints.txt less every package the
                                   target has, plus the target's own versions (local labels dropped), so
                                   what is resolved fits what is installed there
  pick REPORT FREEZE WITH_TORCH TORCH_RE WHEELHOUSE
                                   from pip's --report, write WHEELHOUSE/requirements.txt with what the
                                   target lacks (never ptbench, never the torch stack unless WITH_TORCH=1),
                                   and delete the wheels there that are no longer wanted

An empty FREEZE argument means no target: nothing is left out but the torch stack. A FREEZE that names a
missing or empty file stops with one line naming it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_packages(path: str) -> dict[str, str | None]:
    """name -> version (None: a name alone, a URL or an editable) of each package the target has."""
    if not path:
        return {}
    file = Path(path)
    if not file.is_file():
        sys.exit(f"TARGET_FREEZE={path}: no such file; give the target's `pip freeze` output or its package names")
    found: dict[str, str | None] = {}
    for line in file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:===?\s*([^\s;,]+))?", line)
        if m and not line.startswith("-"):
            found[norm(m[1])] = m[2].split("+", 1)[0] if m[2] else None
    if not found:
        sys.exit(f"TARGET_FREEZE={path}: no package names in it; give the target's `pip freeze` output or its names")
    return found


def constraints(pinned: str, freeze: str) -> str:
    target = target_packages(freeze)
    keep = [
        line
        for line in Path(pinned).read_text().splitlines()
        if line.strip() and not line.startswith("#") and norm(re.split(r"[=<>!~ ;]", line, maxsplit=1)[0]) not in target
    ]
    return "\n".join(keep + [f"{name}=={v}" for name, v in sorted(target.items()) if v]) + "\n"


def pick(report: str, freeze: str, with_torch: str, torch_re: str, wheelhouse: str) -> None:
    target = target_packages(freeze)
    resolved = [(norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.load(open(report))["install"]]
    want = {
        n: v
        for n, v in resolved
        if n != "ptbench" and n not in target and (with_torch == "1" or not re.match(torch_re, n))
    }
    folder = Path(wheelhouse)
    (folder / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(want.items())))
    for wheel in folder.glob("*.whl"):  # earlier builds' wheels, and source-only ones the target already has
        if norm(wheel.name.split("-", 1)[0]) not in {"ptbench", *want}:
            wheel.unlink()
    print(f"{wheelhouse}: {len(want)} of the {len(resolved)} resolved packages (the rest: ptbench or on the target)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["constraints"]:
        print(constraints(*sys.argv[2:4]), end="")
    else:
        pick(*sys.argv[2:7])
