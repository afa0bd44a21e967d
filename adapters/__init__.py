"""Adapter registry: `adapter.name` -> the module that implements it, imported only when chosen.

Heavy frameworks (deepspeed, megatron, horovod, torchgpipe) are imported inside their own adapter
module, so `adapter=ddp` never pays for them (a test checks this).
"""
from __future__ import annotations

import importlib

from bench.errors import ConfigError

# name -> "module:Class"
REGISTRY: dict[str, str] = {
    "ddp": "adapters.ddp:DDPAdapter",
}


def register(name: str, target: str) -> None:
    REGISTRY[name] = target


def get_adapter_class(name: str):
    if name not in REGISTRY:
        raise ConfigError(f"unknown adapter '{name}': choose one of {', '.join(sorted(REGISTRY))} (adapter=NAME)")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
