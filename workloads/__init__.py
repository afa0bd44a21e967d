"""Workload registry: `workload.arch` in the config picks the class; `check_config` refuses what no
workload can build (one line each, before any rank starts)."""

from __future__ import annotations

from ptbench.core.config import DataConfig, WorkloadConfig
from ptbench.core.errors import ConfigError
from ptbench.workloads.base import Workload

ARCHS = ("gpt2", "vgg16", "resnet50")
DATA_SOURCES = {"vision": ("synthetic", "imagefolder"), "language": ("synthetic", "wikitext")}


def check_config(cfg: WorkloadConfig, data: DataConfig) -> None:
    if cfg.kind not in DATA_SOURCES:
        raise ConfigError(f"workload.kind={cfg.kind}: must be vision or language")
    keys = (
        ("n_layer", "n_head", "n_embd", "vocab_size", "seq_len")
        if cfg.kind == "language"
        else ("num_classes", "image_size", "width_div")
    )
    for key in keys:
        value = getattr(cfg, key)
        if value is None or value <= 0:
            raise ConfigError(f"workload.{key}={value} must be > 0")
    if cfg.kind == "language" and cfg.n_embd % cfg.n_head:
        raise ConfigError(f"workload.n_embd={cfg.n_embd} is not divisible by workload.n_head={cfg.n_head}")
    if data.source not in DATA_SOURCES[cfg.kind]:
        raise ConfigError(
            f"data.source={data.source} does not fit {cfg.kind} workload {cfg.name}; "
            f"use one of {', '.join(DATA_SOURCES[cfg.kind])}"
        )
    if cfg.kind != "vision" and cfg.channels_last:
        raise ConfigError(
            f"workload.channels_last=true is for convolutional (vision) workloads, not {cfg.name}; drop it"
        )
    if data.num_workers is not None and data.num_workers < 0:
        raise ConfigError(f"data.num_workers={data.num_workers} must be >= 0")


def build_workload(cfg: WorkloadConfig, data: DataConfig) -> Workload:
    if cfg.arch == "gpt2":
        from ptbench.workloads.gpt2 import GPT2Workload

        return GPT2Workload(cfg, data)
    if cfg.arch in ("vgg16", "resnet50"):
        from ptbench.workloads.vision import VisionWorkload

        return VisionWorkload(cfg, data)
    raise ConfigError(f"unknown workload.arch '{cfg.arch}': choose one of {', '.join(ARCHS)}")
