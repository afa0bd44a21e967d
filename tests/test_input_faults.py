"""Input faults found before any rank starts: an empty WikiText file, a record folder that cannot
be made. Real files, the real command: one line naming the path the user gave, exit 2, no record."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers import SMOKE, run, run_dirs


def _ptbench(*overrides: str) -> tuple[int, str]:
    proc = run([sys.executable, "-m", "ptbench", *SMOKE, *overrides], timeout=300)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("content", ["", "\n \n"], ids=["empty", "blank"])
def test_an_empty_wikitext_file_is_named_before_ranks_start(tmp_path, data_root, content):
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "train.txt").write_text(content)
    shutil.copy(data_root / "wikitext-2" / "valid.txt", wt / "valid.txt")
    code, err = _ptbench(
        "data=wikitext2",
        f"data.root={wt}",
        f"data.tokenizer_dir={data_root / 'gpt2-tokenizer'}",
        f"results.root={tmp_path / 'r'}",
    )
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"error: data.root: {wt / 'train.txt'} is empty (no text to train on): put WikiText's train.txt there "
        "or set data.root=<folder with train.txt and valid.txt>"
    ], err[-3000:]
    assert not run_dirs(tmp_path / "r") and not (wt / ".bench_cache").exists()


def test_a_file_in_the_record_path_is_one_line(tmp_path):
    (tmp_path / "smoke").write_text("not a folder")
    code, err = _ptbench(f"results.root={tmp_path}")
    assert code == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: cannot write the record {tmp_path / 'smoke'}/") and (
        f"{tmp_path / 'smoke'} is a file, not a folder: move it, or choose another results.root=PATH" in line
    ), line
    assert os.listdir(tmp_path) == ["smoke"] and Path(tmp_path / "smoke").is_file()


def test_a_master_port_in_use_is_one_line_before_ranks_start(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = _ptbench(f"launcher.master_port={port}", f"results.root={tmp_path}")
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"error: launcher.master_port={port} is in use on this host (another run or program listens there): "
        "choose another port, or leave launcher.master_port unset for a free one"
    ]
    assert not run_dirs(tmp_path)
