"""The tree stays as ruff's linter and formatter want it (pyproject.toml [tool.ruff]; `make lint` runs the same)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
