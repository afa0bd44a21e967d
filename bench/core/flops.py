"""Dense peak FLOP/s per device and math mode, for MFU. Unknown devices (and CPUs) give None: no MFU
is better than a made-up one.

Keyed by (device, dtype) where dtype is what the matmuls really run in: bf16, fp16, tf32 (fp32
inputs on TF32 tensor cores, `trainer.tf32=true`) or fp32 (no tensor cores on NVIDIA; AMD's fp32
matrix cores). Values are the vendors' datasheet dense (no-sparsity) numbers per device as torch
sees it: an MI250X module is two devices (GCDs), so its row is per GCD.
"""

from __future__ import annotations

import torch

T = 1e12
# (device-name pattern, all substrings must appear) -> {dtype: dense peak FLOP/s}; most specific first
PEAKS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H200", "NVL"), {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T}),
    (("H200",), {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T}),  # SXM
    (("H100", "NVL"), {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T}),
    (("H100", "PCIe"), {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T}),
    (("H100", "HBM3"), {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T}),  # SXM5
    (("H100", "SXM"), {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T}),
    (("A100",), {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}),
    (("L40S",), {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T, "fp16": 362 * T}),
    (("MI300X",), {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T}),
    # per GCD (torch sees each of the module's two GCDs as a device): half of 95.7 / 383 TFLOP/s
    (("MI250X",), {"fp32": 47.9 * T, "bf16": 191.5 * T, "fp16": 191.5 * T}),
]


def math_dtype(precision: str, tf32: bool) -> str:
    """What the matmuls run in: the autocast dtype, else tf32 or fp32."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if tf32 else "fp32"


def peak_for(name: str, dtype: str) -> float | None:
    """The dense peak of a device called `name` in `dtype`, None if the device or mode is not known.
    A bare "H100" (no SXM/PCIe/NVL in its name) is not guessed: its variants differ by 30 %."""
    for keys, table in PEAKS:
        if all(k in name for k in keys):
            return table.get(dtype)
    return None


def peak_flops(device: torch.device, precision: str, tf32: bool = False) -> float | None:
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), math_dtype(precision, tf32))


def mfu(flops_per_s: float | None, peak: float | None, devices: int) -> tuple[float | None, str | None]:
    """(MFU, None), or (None, why) when there is no peak or the ratio exceeds 1: a value above 1 means
    the FLOP count or the peak is wrong for this device, and is never reported as MFU."""
    if not flops_per_s or not peak:
        return None, None
    value = flops_per_s / (peak * devices)
    if value > 1:
        return None, f"computed MFU {value:.2f} > 1: the peak table or the workload's FLOP count is wrong here"
    return value, None


# --- the cross-check: FLOPs counted by torch (torch.utils.flop_counter) beside the formula's --------------
COUNT_CONVENTION = (
    "torch.utils.flop_counter.FlopCounterMode over one forward + backward of the model on the meta device "
    "(shapes only); 2 FLOPs per multiply-add of matmuls and convolutions; attention: on the meta device "
    "scaled_dot_product_attention runs as its math form, two batched matmuls (QK^T, AV) forward and four "
    "backward over the full T x T scores (the causal mask is not discounted, as in the formula); not counted: "
    "biases, normalisation, activations, softmax, pooling, embeddings, the loss, the optimizer; a "
    "convolution's input gradient only where autograd computes it (not the first layer's: the formula "
    "leaves it out too)"
)
FLOPS_TOLERANCE = 0.05  # a disagreement beyond this becomes a warning in the run's summary


def count_train_flops(model, inputs, target, loss) -> dict:
    """{forward, backward, total, by_op} FLOPs of one training step of `model` (on the meta device, or any)
    on `inputs` / `target` with `loss(output, target)`, counted by FlopCounterMode (see COUNT_CONVENTION).
    The caller divides by the batch."""
    from torch.utils.flop_counter import FlopCounterMode

    fwd_counter, bwd_counter = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with torch.enable_grad():
        with fwd_counter:
            out = loss(model(inputs), target)
        with bwd_counter:
            out.backward()
    by_op: dict[str, int] = {}
    for c in (fwd_counter, bwd_counter):
        for op, n in c.get_flop_counts().get("Global", {}).items():
            by_op[str(op)] = by_op.get(str(op), 0) + int(n)
    fwd, bwd = fwd_counter.get_total_flops(), bwd_counter.get_total_flops()
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "by_op": by_op}


def flops_check(formula_per_sample: float, counted_per_sample: float, tolerance: float = FLOPS_TOLERANCE) -> dict:
    """The summary's `flops_check`: both training FLOPs per sample, their ratio (counted / formula) and the
    warning (None when they agree within `tolerance`)."""
    ratio = counted_per_sample / formula_per_sample if formula_per_sample else None
    warning = None
    if ratio is None or abs(ratio - 1) > tolerance:
        shown = "n/a" if ratio is None else f"{ratio:.3f}"
        warning = (
            f"FLOPs counted by torch (FlopCounterMode) are {shown} x the workload's formula (> {tolerance:.0%} apart): "
            "the MFU rests on the formula; check the workload's forward_flops_per_sample"
        )
    return {
        "formula_train_flops_per_sample": float(formula_per_sample),
        "counted_train_flops_per_sample": float(counted_per_sample),
        "ratio": ratio,
        "convention": COUNT_CONVENTION,
        "warning": warning,
    }
