"""Adapter registry: `adapter=NAME` loads module `adapters/NAME.py` and its `ADAPTER` class.

One file per framework, found by name, imported only when chosen: heavy frameworks (deepspeed,
megatron, horovod, torchgpipe) are imported inside their own module, so `adapter=ddp` never pays
for them (a test checks this). Modules starting with "_" are helpers, not adapters.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from bench.errors import ConfigError

_SKIP = {"__init__", "base"}


def available() -> list[str]:
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py") if p.stem not in _SKIP and not p.stem.startswith("_"))


def get_adapter_class(name: str):
    if name not in available():
        raise ConfigError(f"unknown adapter '{name}': choose one of {', '.join(available())} (adapter=NAME)")
    return importlib.import_module(f"adapters.{name}").ADAPTER
