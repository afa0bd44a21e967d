"""Dense peak FLOP/s of known GPUs, for MFU. Unknown devices (and CPUs) give None: no MFU is better
than a made-up one."""
from __future__ import annotations

import torch

# device-name substring -> {precision: dense peak FLOP/s per device} (vendor datasheets, no sparsity)
PEAKS = {
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10G": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "MI250X": {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAKS.items():
        if key in name:
            return table.get(precision)
    return None
