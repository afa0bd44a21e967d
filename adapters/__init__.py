"""Adapter registry: `adapter=NAME` loads module `adapters/NAME.py` and its `ADAPTER` class.

One file per framework, found by name, imported only when chosen: heavy frameworks (deepspeed,
megatron, horovod, torchgpipe) are imported inside their own module, so `adapter=ddp` never pays
for them (a test checks this). The names are the adapter schemas' (adapters/configs.py); modules
starting with "_" are helpers shared by adapters, not adapters.
"""

from __future__ import annotations

import importlib

from ptbench.adapters.configs import SCHEMAS
from ptbench.core.errors import ConfigError


def available() -> list[str]:
    return sorted(SCHEMAS)


def get_adapter_class(name: str):
    if name not in SCHEMAS:
        raise ConfigError(f"unknown adapter '{name}': choose one of {', '.join(available())} (adapter=NAME)")
    return importlib.import_module(f"{__name__}.{name}").ADAPTER


def frameworks() -> dict[str, str]:
    """Distribution name -> import name of every adapter's framework (torch included)."""
    out = {}
    for name in available():
        cls = get_adapter_class(name)
        out[cls.framework] = cls.framework_module
    return out
