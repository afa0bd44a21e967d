"""Workload registry: `workload.arch` in the config picks the class."""
from __future__ import annotations

from bench.config import DataConfig, WorkloadConfig
from bench.errors import ConfigError
from workloads.base import Workload

ARCHS = ("gpt2", "vgg16", "resnet50")


def build_workload(cfg: WorkloadConfig, data: DataConfig) -> Workload:
    if cfg.arch == "gpt2":
        from workloads.gpt2 import GPT2Workload

        return GPT2Workload(cfg, data)
    if cfg.arch in ("vgg16", "resnet50"):
        from workloads.vision import VisionWorkload

        return VisionWorkload(cfg, data)
    raise ConfigError(f"unknown workload.arch '{cfg.arch}': choose one of {', '.join(ARCHS)}")
