"""Shared test setup: the repo on sys.path, and data roots from the environment.

BENCH_DATA_ROOT defaults to <repo>/../shared/data (the offline data next to the repo); CI or a
user points it elsewhere. BENCH_CACHE_DIR defaults to <repo>/.pytest_cache/bench_cache so that
token caches built by tests never land inside the data folder (git ignores .pytest_cache).
"""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("BENCH_DATA_ROOT", str((REPO.parent / "shared" / "data").resolve()))
os.environ.setdefault("BENCH_CACHE_DIR", str(REPO / ".pytest_cache" / "bench_cache"))


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The folder holding wikitext-2/, gpt2-tokenizer/, cifar10-subset/ (skips if absent)."""
    root = Path(os.environ["BENCH_DATA_ROOT"])
    if not root.is_dir():
        pytest.skip(f"BENCH_DATA_ROOT={root} does not exist")
    return root
