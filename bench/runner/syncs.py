"""`trainer.count_syncs=true`: how often each timed step makes the host wait for the device, and where.

A host-device synchronisation stalls the CPU until the GPU drains its queue, so it caps how far the host
can run ahead; a framework that reads a value on the host every step (a gradient norm, an overflow
flag) pays for it in every step. Counted per step, per rank, with the source lines that caused them:

- CUDA: `torch.cuda.set_sync_debug_mode("warn")` makes torch warn at every synchronising op (`.item()`,
  `.cpu()`, device-to-host copies, `nonzero`, ...); the warnings are caught here with the Python line
  that called the op ("implicit"). `torch.cuda.synchronize`, `Stream.synchronize` and
  `Event.synchronize` are counted by wrapping them ("explicit").
- CPU (the twin): nothing waits, so the calls that would on a GPU are counted instead: a tensor's value
  read on the host (`item`, `tolist`, `bool`, `float`, `int`) of a tensor on the run's device, and
  DeepSpeed's accelerator `synchronize`. torch.optim's `step` counters are left out: on CUDA they stay on
  the host (unless capturable or fused), so reading them costs no sync there.

A diagnostic: it wraps functions on the hot path (about a microsecond per counted call), and the record
says a run was counted. Only the timed steps (after trainer.untimed_steps) are reported.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import torch

SYNC_WARNING = "synchronizing CUDA operation"
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
_SKIP = ("/torch/_tensor.py", "/torch/cuda/", __file__)  # frames of the wrappers themselves, not the caller
_ROOT = str(Path(__file__).resolve().parents[2]) + "/"  # the checkout (bench/runner/syncs.py -> ..)


def _site(frame) -> str:
    """`path:line` of the first frame outside torch's tensor/cuda wrappers and this module."""
    while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP):
        frame = frame.f_back
    return "?" if frame is None else f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"


class SyncCounter:
    """Installed once per rank (`install`); `start_step` / `end_step` bracket each optimizer step (the
    PhaseTimer calls them); `result()` is the epoch's timed steps, for the rank's part of the epoch event."""

    def __init__(self, device: torch.device, untimed_steps: int, optimizer=None):
        self.device = torch.device(device)
        self.optimizer = optimizer
        self.host_side: set[int] = set()  # ids of torch.optim's step counters (CPU twin)
        self.untimed = untimed_steps
        self.steps_seen = 0
        self.in_step = False
        self.step_counts: list[dict[str, int]] = []  # this epoch's timed steps
        self.sites: dict[str, int] = {}
        self._undo: list = []

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            return "cuda: set_sync_debug_mode(warn) warnings + wrapped synchronize calls"
        return "cpu twin: host reads (item, tolist, bool, float, int) of device tensors + accelerator synchronize"

    def count(self, kind: str, site: str | None = None) -> None:
        if not self.in_step or self.steps_seen < self.untimed:
            return
        step = self.step_counts[-1]
        step[kind] += 1
        key = f"{kind} {site or _site(sys._getframe(2))}"
        self.sites[key] = self.sites.get(key, 0) + 1

    # --- the step's brackets (PhaseTimer.watch_steps) -----------------------------------------------
    def start_step(self) -> None:
        self.in_step = True
        if self.device.type != "cuda":
            self.host_side = step_counters(self.optimizer)
        if self.steps_seen >= self.untimed:
            self.step_counts.append({"explicit": 0, "implicit": 0})

    def end_step(self) -> None:
        self.in_step = False
        self.steps_seen += 1

    def result(self) -> dict | None:
        """This epoch's counts (then reset for the next epoch); None when no step of it was timed."""
        if not self.step_counts:
            return None
        out = {
            "explicit_per_step": [s["explicit"] for s in self.step_counts],
            "implicit_per_step": [s["implicit"] for s in self.step_counts],
            "sites": dict(sorted(self.sites.items(), key=lambda kv: -kv[1])),
            "method": self.method,
        }
        self.step_counts, self.sites = [], {}
        return out

    # --- installing the counters --------------------------------------------------------------------
    def install(self) -> SyncCounter:
        if self.device.type == "cuda":
            self._wrap_cuda_syncs()
            self._catch_sync_warnings()
            torch.cuda.set_sync_debug_mode("warn")
            self._undo.append(lambda: torch.cuda.set_sync_debug_mode("default"))
        else:
            self._wrap_host_reads()
            self._wrap_accelerator_sync()
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _wrap_cuda_syncs(self) -> None:
        counter = self

        def wrap(original):
            def synchronize(*args, **kwargs):
                counter.count("explicit")
                with warnings.catch_warnings():  # the C++ sync also warns in debug mode: count it once
                    warnings.filterwarnings("ignore", message=f".*{SYNC_WARNING}.*")
                    return original(*args, **kwargs)

            return synchronize

        self._patch(torch.cuda, "synchronize", wrap)
        self._patch(torch.cuda.Stream, "synchronize", wrap)
        self._patch(torch.cuda.Event, "synchronize", wrap)

    def _catch_sync_warnings(self) -> None:
        counter, shown = self, warnings.showwarning
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            counter.count("implicit", f"{_short(filename)}:{lineno}")  # outside steps: dropped, not printed

        warnings.showwarning = show
        self._undo.append(lambda: setattr(warnings, "showwarning", shown))

    def _wrap_host_reads(self) -> None:
        counter, device = self, self.device

        def wrap(original):
            def read(tensor, *args, **kwargs):
                if tensor.device == device and id(tensor) not in counter.host_side:
                    counter.count("implicit")
                return original(tensor, *args, **kwargs)

            return read

        for name in HOST_READS:
            self._patch(torch.Tensor, name, wrap)

    def _wrap_accelerator_sync(self) -> None:
        """DeepSpeed's `get_accelerator().synchronize()`: a device sync on CUDA, a no-op on its CPU accelerator."""
        if "deepspeed" not in sys.modules:  # only a run that imported it can call it
            return
        from deepspeed.accelerator import get_accelerator

        counter = self

        def wrap(original):
            def synchronize(*args, **kwargs):
                counter.count("explicit")
                return original(*args, **kwargs)

            return synchronize

        self._patch(get_accelerator(), "synchronize", wrap)


def step_counters(optimizer) -> set[int]:
    """ids of the `step` tensors in a torch.optim optimizer's state (or a wrapper's `.optimizer`'s)."""
    while optimizer is not None and not isinstance(getattr(optimizer, "state", None), dict):
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is None:
        return set()
    return {id(s["step"]) for s in optimizer.state.values() if isinstance(s, dict) and torch.is_tensor(s.get("step"))}


def _short(path: str) -> str:
    """A path as a reader finds it: from site-packages/ (or an editable install's link tree) for a package,
    from the checkout for the project's own files."""
    return re.sub(r"^.*/(site-packages|__editable__[^/]*)/", "", str(path)).removeprefix(_ROOT)
