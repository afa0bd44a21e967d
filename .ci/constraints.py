"""`make constraints`: constraints.txt again from the installed venv, saying what changed.

    python .ci/constraints.py constraints.txt

Every installed distribution as name==version, less the project itself and pip's own tools (make install
upgrades those first), under the file's own comment header. A package pinned before but not installed here
(Horovod, until `make horovod`) keeps its old pin, and one line says so: dropping it would leave CI and
`make install` without the tested version the next time it is built. Standard library only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SKIP = {"ptbench", "pip", "setuptools", "wheel"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, str]:
    """norm(name) -> the line, for each name==version line."""
    return {norm(line.split("==", 1)[0]): line for line in lines if "==" in line and not line.startswith("#")}


def installed() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "==" in line and norm(line.split("==")[0]) not in SKIP]


def main(path: str) -> None:
    file = Path(path)
    old_lines = file.read_text().splitlines()
    header = [line for line in old_lines if line.startswith("#")]
    old, new = pins(old_lines), pins(installed())
    kept = {n: line for n, line in old.items() if n not in new}
    if kept:
        print(
            f"constraints: kept {len(kept)} pins of packages not installed in this venv, unchanged: "
            f"{', '.join(line for _, line in sorted(kept.items()))} (install them, e.g. `make horovod`, "
            "`pip install -e '.[notebooks]'`, then `make constraints` re-pins them; delete a line to drop it)"
        )
    was = {n: line.split("==", 1)[1] for n, line in old.items()}  # by version: pip may spell the name anew
    now = {n: line.split("==", 1)[1] for n, line in new.items()}
    changed = [f"{old[n]} -> {now[n]}" for n in sorted(new) if n in old and now[n] != was[n]]
    added = sorted(new[n] for n in new if n not in old)
    body = sorted({**new, **kept}.values(), key=lambda line: norm(line.split("==", 1)[0]))
    file.write_text("\n".join(header + body) + "\n")
    print(
        f"constraints: {file}: {len(body)} pins; {len(changed)} changed"
        + (f" ({', '.join(changed)})" if changed else "")
        + f", {len(added)} added"
        + (f" ({', '.join(added[:10])}{', ...' if len(added) > 10 else ''})" if added else "")
        + f", {len(kept)} kept though not installed"
    )


if __name__ == "__main__":
    main(sys.argv[1])
