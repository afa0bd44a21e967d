"""`make wheelhouse TARGET_FREEZE=<file>`: a wheelhouse of only what the target lacks.

TARGET_FREEZE is the target's `pip freeze` (name==version, name @ url, -e lines) or a list of names, one a
line. Three steps, run under the Makefile's venv python (the standard library, pip and its `packaging`):

  constraints CONSTRAINTS FREEZE   print the resolve's constraints: constraints.txt less every package the
                                   target has, plus the target's own versions (local labels dropped), so
                                   what is resolved fits what is installed there
  pick REPORT FREEZE WITH_TORCH TORCH_RE WHEELHOUSE [PIP_TARGET_ARGS...]
                                   from pip's --report, write WHEELHOUSE/requirements.txt with what the
                                   target lacks (never ptbench, never the torch stack unless WITH_TORCH=1),
                                   and delete the wheels there that are no longer wanted
  stamp WHEELHOUSE TARGET          refuse (one line) a folder holding another Python's or platform's wheels;
                                   else record TARGET ("Python 3.12 on manylinux_2_28_x86_64") in it

A package the target names without a version is left out unless a resolved package pins it, or bounds it
from above below its newest release (`setuptools<82` in torch 2.11's requirements, setuptools 82+ released):
the target's unknown version may lie outside, and pip, with no index there, would find nothing to replace it
with ("No matching distribution found for setuptools<82"). With the resolved wheel beside it, pip keeps the
target's copy when it fits and installs this one when it does not. Lower bounds are not covered: a target
older than a requirement fails in one pip line naming it; a TARGET_FREEZE with versions (`pip freeze`) avoids
both.

An empty FREEZE argument means no target: nothing is left out but the torch stack. A FREEZE that names a
missing or empty file stops with one line naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
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


def _upper(spec: str) -> tuple[bool, list[str]]:
    """(an exact pin, the upper bounds as `<X` / `<=X`) of one requirement's specifiers; `~=1.4.2` is `<1.5`,
    `==1.2.*` is `<1.3`. Lower bounds are not looked at: the docstring's limit."""
    exact, upper = False, []
    for op, v in re.findall(r"(===|==|~=|<=|<|>=|>|!=)\s*([^\s,]+)", spec):
        parts = v.split(".")
        if op == "~=" and len(parts) > 1:
            upper.append(f"<{'.'.join(parts[:-2] + [str(int(parts[-2]) + 1)])}")
        elif op == "==" and v.endswith(".*"):
            upper.append(f"<{'.'.join(parts[:-2] + [str(int(parts[-2]) + 1)])}")
        elif op in ("==", "==="):
            exact = True
        elif op in ("<", "<="):
            upper.append(op + v)
    return exact, upper


def bounded_from_above(installs: list[dict], unknown: set[str]) -> dict[str, tuple[bool, list[str], str]]:
    """{name: (exact, upper bounds, 'torch requires setuptools<82')} for each of `unknown` that a resolved
    package's requirement pins or bounds from above. A requirement of an extra counts only if the report says
    the extra was asked for (ptbench's own extras always); other markers are not evaluated."""
    why: dict[str, tuple[bool, list[str], str]] = {}
    for item in installs:
        meta, asked = item["metadata"], set(item.get("requested_extras") or [])
        for req in meta.get("requires_dist") or []:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;)]*)\)?\s*(?:;(.*))?", req)
            extra = re.search(r"extra\s*==\s*[\"']([^\"']+)", m[3] or "") if m else None
            if (
                not m
                or norm(m[1]) not in unknown
                or (extra and norm(meta["name"]) != "ptbench" and extra[1] not in asked)
            ):
                continue
            exact, upper = _upper(m[2])
            if exact or upper:
                old = why.get(norm(m[1]), (False, [], ""))
                why[norm(m[1])] = (
                    old[0] or exact,
                    old[1] + upper,
                    old[2] or f"{meta['name']} requires {m[1]}{m[2].strip()}",
                )
    return why


def newest(names: list[str], pip_target: list[str]) -> dict[str, str]:
    """The newest release of each name for the target's Python and platform (one pip resolve, no download)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--no-deps"]
        cmd += ["--target", tmp, "--report", f"{tmp}/r.json", *pip_target, *names]
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
        return {
            norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.load(open(f"{tmp}/r.json"))["install"]
        }


def fits(version: str, bounds: list[str]) -> bool:
    from packaging.version import Version  # the venv's (pip's own dependency there)

    v = Version(version)
    return all(v < Version(b[1:]) if b[1] != "=" else v <= Version(b[2:]) for b in bounds)


def at_risk(installs: list[dict], target: dict[str, str | None], pip_target: list[str]) -> dict[str, str]:
    """{name: why} of the packages the target lists without a version that the install may have to replace:
    pinned by a resolved package, or bounded from above below the newest release (the target's copy can be no
    newer than that). Without pip_target (the target's --python-version/--platform) every bound counts."""
    bounded = bounded_from_above(installs, {n for n, v in target.items() if v is None})
    loose = sorted(n for n, (exact, _, _) in bounded.items() if not exact)
    latest = newest(loose, pip_target) if pip_target and loose else {}
    return {
        n: why for n, (exact, upper, why) in bounded.items() if exact or n not in latest or not fits(latest[n], upper)
    }


def pick(report: str, freeze: str, with_torch: str, torch_re: str, wheelhouse: str, *pip_target: str) -> None:
    target = target_packages(freeze)
    installs = json.load(open(report))["install"]
    resolved = [(norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in installs]
    bounded = at_risk(installs, target, list(pip_target))
    want = {
        n: v
        for n, v in resolved
        if n != "ptbench" and (n not in target or n in bounded) and (with_torch == "1" or not re.match(torch_re, n))
    }
    for name in sorted(set(bounded) & set(want)):
        print(f"{wheelhouse}: + {name}=={want[name]}, listed on the target without a version: {bounded[name]}")
    folder = Path(wheelhouse)
    (folder / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(want.items())))
    for wheel in folder.glob("*.whl"):  # earlier builds' wheels, and source-only ones the target already has
        if norm(wheel.name.split("-", 1)[0]) not in {"ptbench", *want}:
            wheel.unlink()
    print(f"{wheelhouse}: {len(want)} of the {len(resolved)} resolved packages (the rest: ptbench or on the target)")


def stamp(wheelhouse: str, target: str) -> None:
    folder = Path(wheelhouse)
    mark = folder / ".target"
    has = None  # an empty folder takes any target
    if any(folder.glob("*.whl")):
        has = mark.read_text().strip() if mark.is_file() else "a Python and platform it did not record"
    if has not in (None, target):
        sys.exit(
            f"WHEELHOUSE={wheelhouse} holds wheels for {has}, not {target}: name another folder "
            f"(one per Python and platform, e.g. WHEELHOUSE={folder.name}-py{target.split()[1]}) or remove it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    mark.write_text(target + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["constraints"]:
        print(constraints(*sys.argv[2:4]), end="")
    elif sys.argv[1:2] == ["stamp"]:
        stamp(*sys.argv[2:4])
    else:
        pick(*sys.argv[2:])
