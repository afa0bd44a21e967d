"""CPU stand-ins for the few CUDA-only calls of megatron-core (0.16.1; 0.19.2 tried), so that the adapter's one code
path (GPTModel, Megatron's DDP wrapper, its forward-backward schedules, its gradient-norm helper)
runs on CPU ranks over gloo. Each stand-in replaces a call that raises "Found no NVIDIA driver"
without a GPU, so nothing that works is changed; `enable()` refuses to act when CUDA is available.

What changes (logged once per process by `enable()`):
  1. `torch.cuda.current_device()` returns the CPU device: Megatron allocates its global memory
     buffer (attention scores, sequence-parallel gathers), its DDP gradient buffers and its
     pipeline receive buffers on it.
  2. Megatron's RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`)
     keeps CPU generator states instead of CUDA ones; same seeds, same forking.
  3. Inside `cuda_to_cpu()` only (model construction, the schedule call, the grad-norm helper):
     factory calls with `device="cuda"` allocate on the CPU and `Tensor.cuda()` returns the tensor.
     They are the schedules' token counter, the first/last-stage copy of the tied embedding
     (`weight.data.cuda()`) and the norm buffers of `get_grad_norm_fp32`.
  4. Inside `cuda_to_cpu()` only: `torch.cuda.synchronize()` does nothing (there is no CUDA work to
     wait for). dist_checkpointing's torch_dist writer calls it after copying tensors to the CPU.
  5. Inside `cuda_to_cpu()` only: `torch.cuda.current_stream()` is a stream that waits for nothing.
     megatron-core 0.19's gradient sync waits on it for CUDA-graph replay events, which a CPU run has none of.
Handled by configuration instead (see adapters/megatron.py): fusions off, `use_cpu_initialization`,
an explicit causal mask (`get_default_causal_mask` hard-codes cuda), `batch_p2p_sync=False`
(a `torch.cuda.synchronize` after each p2p batch), and a torch optimizer (Megatron's optimizers
call CUDA in many more places).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_log = logging.getLogger("ptbench.adapters.megatron")
_enabled = False

CHANGES = (
    "torch.cuda.current_device() -> cpu",
    "Megatron RNG tracker on CPU generator states",
    "device='cuda' factories and Tensor.cuda() -> cpu inside model build / schedule / grad norm / checkpoint",
    "torch.cuda.synchronize() a no-op inside the same calls",
    "torch.cuda.current_stream() a stream that waits for nothing inside the same calls",
)


def _refuse_on_cuda() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(
            "ptbench.adapters._megatron_cpu: CUDA is available, so Megatron must run on the GPU unpatched; "
            "this CPU compatibility module refuses to act"
        )


def enable(announce: bool = True) -> None:
    """Install stand-ins 1 and 2 for this process (idempotent). Call after `initialize_model_parallel`."""
    global _enabled
    _refuse_on_cuda()
    if _enabled:
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: _CPU
    # Megatron creates the tracker lazily; installing ours first makes every later lookup return it.
    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class(mrandom)()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _enabled = True
    if announce:
        _log.warning("megatron on CPU: %s (adapters/_megatron_cpu.py)", "; ".join(CHANGES))


def _cpu_tracker_class(mrandom):
    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker with CPU generator states (same names, seeds and fork semantics)."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CPURNGStatesTracker


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, str | torch.device):
            device = torch.device("cuda", device)  # a bare int means a CUDA ordinal
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


class _NoStream:
    """The current stream of a CPU rank: there is no device work to order, so every wait is already met."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cuda_to_cpu():
    """Stand-ins 3, 4 and 5, for the duration of a Megatron call."""
    _refuse_on_cuda()
    synchronize, current_stream = torch.cuda.synchronize, torch.cuda.current_stream
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NoStream()
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_stream = synchronize, current_stream
