"""The torch releases this project is tested on: the one list `make test-torch` installs from and the run's
one-line warning reads. Standard library only, so .ci/torch_matrix.sh can read it without the project installed.

Each entry: torch minor -> (the exact torch release the matrix installs, the torchvision built for it, the
Pythons it passed on). pyproject.toml's torch/torchvision ranges and the README's "Tested environments"
table follow it (tests/test_environments.py checks the range).
"""

from __future__ import annotations

import re

TESTED_TORCH = {
    "2.11": ("2.11.0", "0.26.0", ("3.12",)),
    "2.14": ("2.14.1", "0.29.1", ("3.11",)),
    # 0.29.2 is built against torch's stable ABI (torchvision/_C_stable.so): the index has no 0.30
    "2.15": ("2.15.0", "0.29.2", ("3.12", "3.13")),
}


def torch_minor(version: str) -> str | None:
    """'2.14.0a0+5228986c39.nv26.1' -> '2.14' (NGC and local builds keep their release's minor)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m[1]}.{m[2]}" if m else None


def untested_torch(version: str) -> str | None:
    """One line when `version` is outside the tested list, else None."""
    if torch_minor(version) in TESTED_TORCH:
        return None
    tested = ", ".join(TESTED_TORCH)
    return (
        f"torch {version} is not among the tested releases ({tested}): the run goes on, but results and "
        "fixes are unverified on it; `make test-torch TORCH=<minor> PYTHON=<x.y>` tests it"
    )


def torch_warnings() -> list[str]:
    """The installed torch's warning, as a list for a run's warnings (empty: tested, or torch absent)."""
    try:
        import torch
    except ImportError:
        return []
    line = untested_torch(torch.__version__)
    return [line] if line else []
