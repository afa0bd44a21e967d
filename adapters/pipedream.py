"""PipeDream's asynchronous pipeline: a re-implementation of PipeDream's published semantics.

No maintained library runs it on current torch (msr-fiddle/pipedream stops at torch 1.4; fairscale's AMPnet
pipe keeps no weight stash), so this adapter implements the update rules itself, on the `pipeline` adapter's
stages (`workload.sequential()` split by layer count or `adapter.balance`, adapters/_pipeline.py) with
torch.distributed's public point-to-point calls (`batch_isend_irecv`); no private pipelining API is used.

Schedules (`adapter.schedule`), one rank per stage, stage s of S, mini-batch t, d_s = S-1-s:
  - `pipedream` (Narayanan et al., SOSP 2019): 1F1B without a flush. Stage s forwards mini-batch t, then runs
    the backward of the oldest one in flight and steps its own optimizer: w_s(t+1) = w_s(t) - lr * grad of
    mini-batch t at w_s(t - d_s). Weight stashing: a mini-batch's forward and backward use the same version,
    so stage s holds d_s stashed versions beside its live weights. With `adapter.microbatches` m > 1, each
    mini-batch is m micro-batches in 1F1B order sharing one version and one step (delay ceil(d_s / m)).
  - `2bw` (Narayanan et al., ICML 2021): m micro-batches per mini-batch, gradients accumulated over them,
    every stage w(t+1) = w(t) - lr * grad f(w(t-1)); two versions (live and one stashed). Needs m >= S-1 so that
    w(t-1) exists on the first stage when mini-batch t starts.

Stash without recomputation: a mini-batch runs through `torch.func.functional_call` on leaves that alias the
storage of the stage's weights at that time (`Tensor.data`). Before the optimizer step writes in place, the
live weights move to fresh storage when a mini-batch in flight still holds the old one (copy on write), so
no tensor autograd saved is ever modified; the old storage is the stash and dies with its last mini-batch.

No flush inside an epoch: the pipeline drains at the epoch's end (`end_epoch`, before validation) and every
`adapter.flush_every` mini-batches when set (0: never). The trainer's stop check (every
`trainer.stop_check_every` steps) is the only collective between stages inside an epoch.

GPT-2's tied embedding / head: the weight belongs to the embedding's stage. That stage sends the version its
mini-batch uses to the head's stage with the mini-batch, and the head's stage sends its summed gradient back
after the mini-batch's backward; the sum updates the weight with the embedding stage's delay.

BatchNorm buffers are not stashed (as PipeDream): running statistics are the live ones, updated per micro-batch.
Gradient clipping (`trainer.grad_clip`) is per stage: a global norm would need every stage's gradient of one
mini-batch, which asynchronous stages compute at different times. More ranks than stages (PipeDream's stage
replication) is refused before launch, as are checkpoints (the stash and the mini-batches in flight are not saved)
and trainer.profile (torch's profiler crashed when a c10d send started in its window completed after it; the
exchanges now complete inside their step, but no profiled run has shown it safe yet); the record's
recv_wait_fraction_per_stage stands in for the bubble.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ptbench.adapters import _pipeline as P
from ptbench.adapters.base import Adapter, Batch, tensor_bytes
from ptbench.core.config import BenchConfig
from ptbench.core.errors import ConfigError
from ptbench.core.layout import CostInputs, Layout
from ptbench.core.optim import build_optimizer
from ptbench.core.precision import autocast
from ptbench.core.timing import DeviceEventClock, HostClock, PhaseTimer
from ptbench.workloads import build_workload

SCHEDULES = ("pipedream", "2bw")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
# point-to-point tags: one stream per kind between two stages, matched in order (gloo by tag, NCCL by order)
ACT, GRAD, TIED, TIED_GRAD, EVAL = 1, 2, 3, 4, 5


@dataclass
class InFlight:
    """One micro-batch whose forward ran on this stage and whose backward has not."""

    version: int  # the stage's update count when its weights were bound (its mini-batch's version)
    minibatch: int
    last: bool  # the last micro-batch of its mini-batch: its backward completes the mini-batch
    inp: torch.Tensor | None  # the received activation (a leaf: its gradient goes back)
    out: torch.Tensor  # the stage output, or on the last stage the scaled loss
    leaves: dict[str, torch.Tensor]  # the weights it ran with: leaves over the stashed storage


class ExchangeMeter:
    """Time spent waiting for exchanges beside time busy (train_step and drains), on the clock that sees the wait.

    Gloo blocks the host until a batch completes: host time. NCCL's `wait()` returns at once and only makes the
    current stream wait, so on a GPU host time reads about 0: there each span is a pair of CUDA events on the
    stream (the clock of the trainer's phase timers, ptbench.core.timing), read when they have completed."""

    def __init__(self, device: torch.device):
        self.clock = DeviceEventClock(device) if device.type == "cuda" else HostClock()
        self.spans: list[tuple[str, object, object]] = []  # (kind, start mark, end mark), not yet read
        self.total = {"wait": 0.0, "busy": 0.0}

    @contextmanager
    def span(self, kind: str):
        a = self.clock.mark()
        try:
            yield
        finally:
            self.spans.append((kind, a, self.clock.mark()))

    def settle(self, wait: bool = False) -> None:
        """Add up the spans whose end has been reached (all of them with `wait`, after a sync), oldest first."""
        if wait:
            self.clock.synchronize()
        n = 0
        for kind, a, b in self.spans:
            if not (wait or not hasattr(b, "query") or b.query()):
                break
            self.total[kind] += self.clock.elapsed(a, b)
            n += 1
        del self.spans[:n]

    def fraction(self) -> float | None:
        self.settle(wait=True)
        return self.total["wait"] / self.total["busy"] if self.total["busy"] > 0 else None


class PipedreamAdapter(Adapter):
    name = "pipedream"
    checkpoint_format = "none (refused: the stashed versions and the mini-batches in flight are not saved)"
    phase_semantics = {
        **Adapter.phase_semantics,
        "forward_backward": "this stage's share of one mini-batch: forward of its m micro-batches and backward "
        "of the oldest ones in flight (stashed weights), in 1F1B order, with the stage-to-stage sends, receives "
        "and the waits for them; no flush (the pipeline fills in the first steps, drains at the epoch's end)",
        "optimizer": "this stage's own step for the mini-batch whose backward completed (per-stage clip, copy on "
        "write of weights still held by mini-batches in flight); no collective between stages",
    }

    # --- before launch ---------------------------------------------------------------------------
    @classmethod
    def smoke_overrides(cls, devices: int) -> list[str]:
        return [f"launcher.nprocs={devices}"]

    @classmethod
    def num_stages(cls, cfg: BenchConfig, world_size: int) -> int:
        a = cfg.adapter
        return len(a.balance) if a.balance is not None else (a.pipeline_parallel or world_size)

    @classmethod
    def microbatches(cls, cfg: BenchConfig, stages: int) -> int:
        return cfg.adapter.microbatches or (stages if cfg.adapter.schedule == "2bw" else 1)

    @staticmethod
    def delays(schedule: str, stages: int, m: int) -> list[int]:
        """Each stage's staleness in optimizer updates: its mini-batch's gradient is taken at w(t - delay)."""
        if schedule == "2bw":
            return [1] * stages
        return [math.ceil((stages - 1 - s) / m) for s in range(stages)]

    @classmethod
    def stash_copies(cls, cfg: BenchConfig, world_size: int) -> list[int]:
        """Extra copies of each stage's parameters (beyond the live ones) that the stash holds at its peak, by the
        memory model's rule for the weight versions `cost_inputs` states (S-1-s for pipedream, ceil((S-1-s)/m)
        with m micro-batches, 1 for 2bw; a drain every adapter.flush_every < 2 x copies mini-batches keeps it
        lower: `ptbench.core.memory_model.stash_copies`)."""
        from ptbench.core.memory_model import stash_copies

        stages = cls.num_stages(cfg, world_size)
        rule = cls.cost_inputs(cfg, layers=False).weight_stash
        return stash_copies(rule, stages, cls.microbatches(cfg, stages), cfg.adapter.flush_every)

    @classmethod
    def paper_layout(cls, gpus: int, gpus_per_node: int, layers: int) -> list[str] | str:
        if gpus < 2:
            return "one stage is no pipeline (plain SGD, no staleness to measure)"
        if gpus > layers:  # one stage per rank, stages not replicated
            return f"one stage per rank and no stage replication: {gpus} ranks for {layers} layers"
        return [f"launcher.nprocs={gpus}"]

    @classmethod
    def paper_companions(cls, point: list[str]) -> list[list[str]]:
        """Beside a PipeDream point, at its rank count, global batch and learning rate: PipeDream-2BW, the flushing
        pipeline (1F1B) and DDP (the same fixed global batch split over the ranks): the staleness claim's
        comparators (analysis/claims.py)."""
        own = [o for o in point if not o.startswith(("adapter=", "adapter."))]
        ranks = next((o.split("=", 1)[1] for o in point if o.startswith("launcher.nprocs=")), "1")
        out = []
        if not any(o.startswith("adapter.schedule=") for o in point):
            out.append([*point, "adapter.schedule=2bw"])
        out.append([*own, "adapter=pipeline", "adapter.schedule=1f1b", f"adapter.pipeline_parallel={ranks}"])
        out.append([*own, "adapter=ddp", "adapter.batch_policy=fixed"])
        return out

    @classmethod
    def layout(cls, cfg: BenchConfig, world_size: int) -> Layout:
        stages = cls.num_stages(cfg, world_size)
        return Layout(world_size=world_size, dp=1, pp=stages, microbatches=cls.microbatches(cfg, stages))

    @classmethod
    def cost_inputs(cls, cfg: BenchConfig, layers: bool = True) -> CostInputs:
        # activations alive as under 1F1B (at most S-s micro-batches on stage s); per micro-batch one activation
        # forward and one gradient back, as 1F1B. The stash: the weight versions this schedule keeps and what one
        # version of each layer holds (the memory model splits them by the balance and the layout's stages)
        a = cfg.adapter
        return CostInputs(
            schedule="1f1b",
            step_phase="forward_backward",
            stage_balance=tuple(a.balance) if a.balance else None,
            weight_stash="double_buffered" if a.schedule == "2bw" else "weight_stashing",
            flush_every=a.flush_every,
            layer_params=cls.layer_params(cfg) if layers else None,
        )

    @classmethod
    def layer_params(cls, cfg: BenchConfig) -> tuple[int, ...]:
        """Parameter elements of each layer of `workload.sequential()`, counted on the meta device, a tied
        weight once (under its first layer: the head's copy is sent with each mini-batch, not stashed)."""
        workload = build_workload(cfg.workload, cfg.data)
        with torch.device("meta"):
            seq = workload.sequential(workload.build_model())
        counts = dict.fromkeys(dict(seq.named_children()), 0)
        for name, p in seq.named_parameters():  # a shared Parameter is listed once
            counts[name.split(".", 1)[0]] += p.numel()
        return tuple(counts.values())

    @classmethod
    def checkpoint_refusal(cls, cfg: BenchConfig) -> str | None:
        return (
            "adapter=pipedream does not save its stashed weight versions and the mini-batches in flight, so a "
            "resumed run would not follow PipeDream's update rule"
        )

    @classmethod
    def check(cls, cfg: BenchConfig, world_size: int) -> None:
        a, t = cfg.adapter, cfg.trainer
        if a.schedule not in SCHEDULES:
            raise ConfigError(f"adapter.schedule={a.schedule}: choose {', '.join(SCHEDULES)}")
        if t.precision == "fp16":
            raise ConfigError(
                "trainer.precision=fp16: adapter=pipedream has no gradient scaler (stages step at different "
                "times, so an overflow cannot skip one step everywhere); use trainer.precision=bf16 or fp32"
            )
        if t.profile:
            raise ConfigError(
                "trainer.profile: adapter=pipedream is not profiled (torch's profiler crashed with SIGSEGV when a c10d "
                "send started in its window completed after it, as this adapter's sends once did); drop trainer.profile "
                "(the record's recv_wait_fraction_per_stage gives the bubble)"
            )
        if t.grad_accum != 1:
            raise ConfigError(
                f"trainer.grad_accum={t.grad_accum}: adapter=pipedream steps once per mini-batch and splits it "
                f"itself; set trainer.grad_accum=1 and adapter.microbatches={t.grad_accum}"
            )
        if a.flush_every < 0:
            raise ConfigError(f"adapter.flush_every={a.flush_every} must be >= 0 (0: no flush inside an epoch)")
        stages = cls.num_stages(cfg, world_size)
        if stages != world_size:
            raise ConfigError(
                f"adapter=pipedream runs one stage per rank and does not replicate stages: {world_size} ranks "
                f"for {stages} stages; set launcher.nprocs={stages}"
            )
        where = f"adapter.balance ({stages} entries)" if a.balance is not None else f"{stages} ranks"
        workload = build_workload(cfg.workload, cfg.data)
        P.check_split(a.balance, P.layer_count(workload), stages, cfg.workload.name, where)
        m = cls.microbatches(cfg, stages)
        P.check_microbatches(cls.local_batch_size(cfg, world_size), m, "the mini-batch")
        if a.schedule == "2bw" and m < stages - 1:
            raise ConfigError(
                f"adapter.schedule=2bw needs adapter.microbatches >= stages - 1 = {stages - 1} (PipeDream-2BW's "
                f"m >= pipeline depth: w(t-1) must exist on the first stage when mini-batch t starts); got {m}"
            )

    # --- on each rank ----------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return 0  # every stage reads the same mini-batch (the first stage its inputs, the last its targets)

    @property
    def reports_metrics(self) -> bool:
        return self.is_last

    def setup(self) -> None:
        cfg, a = self.cfg, self.cfg.adapter
        S = self.S = self.ctx.world_size
        s = self.stage = self.ctx.rank
        self.is_first, self.is_last = s == 0, s == S - 1
        self.schedule = a.schedule
        self.m = self.microbatches(cfg, S)
        self.depth = S - 1 - s  # micro-batches in flight beyond the newest (1F1B)
        # every rank builds the whole model from the same seed, keeps its stage's layers, drops the rest
        seq = self.workload.sequential(self.workload.build_model())
        self.balance = P.check_split(a.balance, len(seq), S, cfg.workload.name, "adapter.balance")
        self.ties = self._untie(seq)
        self.tied_bytes = [seq.get_parameter(mn).numel() * seq.get_parameter(mn).element_size() for mn, *_ in self.ties]
        slices = P.stage_slices(self.balance)
        layers = list(seq.named_children())
        copies = {c for _, c, _, _ in self.ties}
        self.stage_param_bytes = [  # what one stashed copy of each stage costs (a tied copy is not stashed)
            sum(
                p.numel() * p.element_size()
                for n, p in nn.Sequential(OrderedDict(layers[sl])).named_parameters()
                if n not in copies
            )
            for sl in slices
        ]
        self.module = nn.Sequential(OrderedDict(layers[slices[s]])).to(self.device)
        del seq, layers
        self.trained = [(n, p) for n, p in self.module.named_parameters() if n not in copies]
        self.optimizer = build_optimizer([p for _, p in self.trained], cfg.optimizer)
        self.version = 0  # optimizer steps taken on this stage
        self.minibatch = 0  # mini-batches started on this stage (over the whole run)
        self.inflight: deque[InFlight] = deque()
        self.bound: tuple[int, dict] | None = None  # the version the current mini-batch runs with
        self.prev: tuple[int, dict] | None = None  # 2bw: the version before the last step
        self.pending: list[tuple[list, torch.Tensor | None]] = []  # completed mini-batches' gradients
        self.tied_grad: torch.Tensor | None = None  # the head's sum over the micro-batches of its mini-batch
        self.tied_out = [deque() for _ in self.ties]  # the head's: summed gradients not yet sent (at most one)
        self.tied_in = [deque() for _ in self.ties]  # the main stage's: received, for its mini-batches to complete
        self.grad_pending: torch.Tensor | None = None  # the last backward's input gradient, for the previous stage
        self.shapes: dict = {}  # ACT's spec from the previous stage, from its first header
        self.headed: set = set()  # (side, peer) streams whose ACT header went
        self.segment = 0  # mini-batches since the last flush
        self.flushes = 0
        self.observed = [None, None]  # min, max delay seen by this stage's steps
        self.stash_peak = 0
        self.meter = ExchangeMeter(self.device)  # time waiting for exchanges / busy in train_step and drains
        self.stage_stats: list[dict] | None = None  # every stage's, gathered at each epoch's end

    def _untie(self, seq: nn.Sequential) -> list[tuple[str, str, int, int]]:
        """Tied weights whose users land on different stages: the copy gets its own Parameter (its values come
        from the main stage with each mini-batch); returns (main, copy, main stage, copy stage)."""
        out = []
        for main, copy in self.workload.tied_parameters(sequential=True):
            s_main = P.stage_of_layer(self.balance, P.layer_index(seq, main))
            s_copy = P.stage_of_layer(self.balance, P.layer_index(seq, copy))
            if s_main != s_copy:
                if s_main > s_copy:
                    raise ConfigError(f"tied weight {main} lies after its copy {copy}: not supported by pipedream")
                out.append((main, copy, s_main, s_copy))
        P.untie(seq, [(mn, c) for mn, c, _, _ in out])
        return out

    def modules(self):
        return [self.module]

    # --- point to point --------------------------------------------------------------------------
    # Every exchange is one `dist.batch_isend_irecv` batch with one peer, waited before going on, as Megatron's
    # p2p_communication.py (`send_forward_recv_backward`, `send_backward_recv_forward` through `_batched_p2p_ops`) and
    # torch.distributed.pipelining (`_sorted_batch_p2p`: one batch per peer) do. Under NCCL a rank's batches run on
    # one stream in issue order and a send completes only with its peer's matching receive, so both sides of a pair
    # must reach matching batches at the same point of the schedule; `train_step` is built so that they do, and so
    # that nothing is left pending at a step's end (tests/test_pipedream_nccl_order.py replays the real issue order
    # under that rule). Only ACT and EVAL carry a shape header: the other streams' shapes are known on both sides.
    def _exchange(self, peer: int, sends: Sequence = (), recvs: Sequence = ()) -> list[torch.Tensor]:
        """Send each (tensor, tag) to `peer` and receive each (tag, spec or None) from it, in one batch; returns the
        received tensors. A spec of None (a stream's first ACT, every EVAL) is sent ahead in a batch of headers."""
        sends = [(t.detach().contiguous(), tag) for t, tag in sends]
        heads_out = [(self._header(t), tag) for t, tag in sends if self._headed(peer, tag, "send")]
        heads_in = [(torch.empty(8, dtype=torch.int64, device=self.device), tag) for tag, spec in recvs if spec is None]
        if heads_out or heads_in:
            self._batch(peer, heads_out, heads_in)
            got = iter(self._spec(h.tolist()) for h, _ in heads_in)
            recvs = [(tag, spec if spec is not None else next(got)) for tag, spec in recvs]
            self.shapes.update((peer, spec) for tag, spec in recvs if tag == ACT)
        bufs = [(torch.empty(spec[1], dtype=spec[0], device=self.device), tag) for tag, spec in recvs]
        if sends or bufs:
            self._batch(peer, sends, bufs)
        return [b for b, _ in bufs]

    def _batch(self, peer: int, sends: list, recvs: list) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, tag in recvs]
        works = dist.batch_isend_irecv(ops)
        with self.meter.span("wait"):  # on a GPU: the stream's wait for the batch, timed by events
            for w in works:
                w.wait()

    def _headed(self, peer: int, tag: int, side: str) -> bool:
        """Whether this message goes after a shape header: every EVAL one (the last validation batch may be smaller),
        the first ACT one of each stream (training shapes are fixed). Both sides count the same messages."""
        if tag == EVAL:
            return True
        if tag != ACT or (side, peer) in self.headed:
            return False
        self.headed.add((side, peer))
        return True

    @staticmethod
    def _header(t: torch.Tensor) -> torch.Tensor:
        head = torch.zeros(8, dtype=torch.int64, device=t.device)
        head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
        head[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return head

    @staticmethod
    def _spec(h: list[int]) -> tuple[torch.dtype, torch.Size]:
        return _DTYPES[h[0]], torch.Size(h[2 : 2 + h[1]])

    def _tied_exchange(self, weights: dict | None, grads: bool) -> None:
        """Between the stages that split a tied weight, first thing in a step and at a drain's start and end: the main
        stage sends the version `weights` holds (None: none goes) and, with `grads`, gets the head's summed gradient
        of the one mini-batch the head completed since the last exchange."""
        for j, (main, copy, s_main, s_copy) in enumerate(self.ties):
            if self.stage == s_main:
                p = self.module.get_parameter(main)
                sends = [(weights[main], TIED)] if weights is not None else []
                self.tied_in[j].extend(
                    self._exchange(s_copy, sends, [(TIED_GRAD, (p.dtype, p.shape))] if grads else [])
                )
            elif self.stage == s_copy:
                p = self.module.get_parameter(copy)
                if len(self.tied_out[j]) != int(grads):
                    raise RuntimeError(f"pipedream: stage {self.stage} holds {len(self.tied_out[j])} tied gradients")
                sends = [(self.tied_out[j].pop(), TIED_GRAD)] if grads else []
                got = self._exchange(s_main, sends, [(TIED, (p.dtype, p.shape))] if weights is not None else [])
                if got:
                    p.data = got[0]  # the head's copy is the version just received
                    if self.bound is not None:
                        self.bound[1][copy] = got[0]

    # --- weight versions -------------------------------------------------------------------------
    def _live(self) -> dict[str, torch.Tensor]:
        """The live weights as tensors over their storage, outside autograd's version counting (`.data`): the
        optimizer's in-place step never writes storage a mini-batch holds (`_copy_on_write`)."""
        return {n: p.data for n, p in self.trained}

    def _bind(self) -> None:
        """The version mini-batch `self.minibatch` runs with on this stage, and the tied weight's exchange."""
        t = self.minibatch
        if self.schedule == "pipedream":
            self.bound = (self.version, self._live())
        else:  # 2bw: w(t-1) for every stage
            want = max(t - 1, 0)
            if self.version == want:
                self.bound = (want, self._live())
            elif self.prev is not None and self.prev[0] == want:
                self.bound = (want, dict(self.prev[1]))
            else:
                raise RuntimeError(f"2bw: stage {self.stage} has version {self.version}, mini-batch {t} needs {want}")
        self._tied_exchange(self.bound[1], grads=self.segment > 0)

    def _copy_on_write(self) -> None:
        """Before an in-place step: move the live weights to fresh storage when a mini-batch in flight (or 2bw's
        previous version) still holds them; the old storage becomes the stash."""
        held = {e.version for e in self.inflight}
        if self.bound is not None:
            held.add(self.bound[0])
        keep = self.schedule == "2bw"
        if self.prev is not None and self.prev[0] not in held:
            self.prev = None  # released before the clone, so the peak is one stashed copy
        if self.version in held or keep:
            old = self._live()
            for _, p in self.trained:
                p.data = p.data.clone()
            if keep:
                self.prev = (self.version, old)

    def _stash_bytes(self) -> int:
        """Bytes of weight storage held by mini-batches in flight and 2bw's previous version, beyond the live."""
        live = {p.data.untyped_storage().data_ptr() for _, p in self.trained}
        held = [e.leaves for e in self.inflight] + ([self.prev[1]] if self.prev else [])
        names = {n for n, _ in self.trained}
        seen: dict[int, int] = {}
        for leaves in held:
            for n, w in leaves.items():
                st = w.untyped_storage()
                if n in names and st.data_ptr() not in live:
                    seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    # --- the schedule ----------------------------------------------------------------------------
    # Micro-batch k on stage s (d_s = S-1-s in flight beyond the newest): the batch with the previous stage (receive
    # ACT(k), send the input gradient of the last backward), the forward, the batch with the next stage (send ACT(k),
    # receive the gradient of the oldest micro-batch in flight when its backward is due), that backward. Stage s's
    # batch with s+1 and stage s+1's batch with s hold each other's matches at the same k; the gradient of a step's
    # last backward waits on the host for the next step's first batch (or the drain), so nothing is left pending at
    # a step's end. The order of forwards, backwards and steps is the one of plain 1F1B without a flush.
    def _from_prev(self) -> torch.Tensor | None:
        if self.is_first:
            return None
        sends = [(self.grad_pending, GRAD)] if self.grad_pending is not None else []
        self.grad_pending = None
        return self._exchange(self.stage - 1, sends, [(ACT, self.shapes.get(self.stage - 1))])[0]

    def _to_next(self, out: torch.Tensor | None) -> torch.Tensor | None:
        """Send `out` (None in a drain) and receive the oldest micro-batch's output gradient when its backward is due."""
        due = len(self.inflight) > (self.depth if out is not None else 0)
        if self.is_last or not (due or out is not None):
            return None
        oldest = self.inflight[0].out
        sends = [(out, ACT)] if out is not None else []
        got = self._exchange(self.stage + 1, sends, [(GRAD, (oldest.dtype, oldest.shape))] if due else [])
        return got[0] if due else None

    def _forward(self, x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor | None:
        if i == 0:
            self._bind()
        version, weights = self.bound
        inp = self._from_prev()
        if inp is not None:
            inp.requires_grad_()
        # Parameters over the version's storage (no copy): what autograd saves of them is weights, which the memory
        # ledger (ptbench.core.memory.SavedTensorLedger) recognises as parameters, not as saved activations
        leaves = {n: nn.Parameter(w.detach()) for n, w in weights.items()}
        with autocast(self.cfg.trainer.precision, self.device):
            out = torch.func.functional_call(self.module, leaves, (x if self.is_first else inp,))
            if self.is_last:
                out = self.workload.loss(out, y) / self.m
        last = i == self.m - 1
        self.inflight.append(InFlight(version, self.minibatch, last, inp, out, leaves))
        if last:
            self.bound = None  # all its micro-batches hold the version now
        grad_out = self._to_next(None if self.is_last else out)
        if len(self.inflight) > self.depth:
            self._backward(grad_out)
        return out.detach() if self.is_last else None

    def _backward(self, grad_out: torch.Tensor | None) -> None:
        e = self.inflight.popleft()
        names = list(e.leaves)
        inputs = [e.leaves[n] for n in names] + ([e.inp] if e.inp is not None else [])
        grads = torch.autograd.grad(e.out, inputs, grad_out, allow_unused=True)
        if e.inp is not None:
            self.grad_pending = grads[-1]  # sent with the next batch to the previous stage
        by_name = dict(zip(names, grads))
        for n, p in self.trained:
            g = by_name.get(n)
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        for _, copy, _, s_copy in self.ties:
            if self.stage == s_copy and by_name.get(copy) is not None:
                g = by_name[copy]
                self.tied_grad = g if self.tied_grad is None else self.tied_grad.add_(g)
        if e.last:
            self._complete(e)

    def _complete(self, e: InFlight) -> None:
        """Mini-batch `e.minibatch`'s backward is done here: the head's stage keeps its tied gradient for the next
        tied exchange, the main stage adds the one it got (in mini-batch order); its gradients wait for its step."""
        for j, (main, _, s_main, s_copy) in enumerate(self.ties):
            if self.stage == s_copy:
                self.tied_out[j].append(self.tied_grad)
                self.tied_grad = None
            elif self.stage == s_main:
                g = self.tied_in[j].popleft()
                p = self.module.get_parameter(main)
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.pending.append(([p.grad for _, p in self.trained], e.version))
        for _, p in self.trained:
            p.grad = None

    @torch.no_grad()
    def _step(self) -> None:
        accumulating = [p.grad for _, p in self.trained]  # the next mini-batch's first micro-batches
        for grads, version in self.pending:
            for (_, p), g in zip(self.trained, grads):
                p.grad = g
            clip = self.cfg.trainer.grad_clip
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in self.trained], clip)
            self._copy_on_write()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            delay = self.version - version
            lo, hi = self.observed
            self.observed = [delay if lo is None else min(lo, delay), delay if hi is None else max(hi, delay)]
            self.version += 1
            self.stash_peak = max(self.stash_peak, self._stash_bytes())
        self.pending = []
        for (_, p), g in zip(self.trained, accumulating):
            p.grad = g

    def train_step(self, micro_batches: Sequence[Batch], timer: PhaseTimer):
        (x, y), losses = micro_batches[0], []
        with self.meter.span("busy"):
            with timer.phase("forward_backward"):
                for i, (xi, yi) in enumerate(zip(x.chunk(self.m), y.chunk(self.m))):
                    loss = self._forward(xi, yi, i)
                    if loss is not None:
                        losses.append(loss)
                self.minibatch += 1
                self.segment += 1
            with timer.phase("optimizer"):
                self._step()  # deferred to the end of the call: binds happen at its start, so the rule is the same
            if self.cfg.adapter.flush_every and self.segment % self.cfg.adapter.flush_every == 0:
                with timer.phase("forward_backward"):
                    self._flush()
        self.meter.settle()
        return torch.stack(losses).sum() if self.is_last else None

    def _flush(self) -> None:
        """Drain: the head's last tied gradient, then the backward and step of every mini-batch in flight (a gradient
        goes back as soon as it exists: in a drain it flows one way only), then the head gets the live tied weight."""
        self._tied_exchange(None, grads=self.segment > 0)
        if self.grad_pending is not None:
            self._exchange(self.stage - 1, [(self.grad_pending, GRAD)])
            self.grad_pending = None
        while self.inflight:
            self._backward(self._to_next(None))
            if self.grad_pending is not None:
                self._exchange(self.stage - 1, [(self.grad_pending, GRAD)])
                self.grad_pending = None
            self._step()
        self._tied_exchange(self._live(), grads=False)
        self.segment = 0
        self.flushes += 1

    def end_epoch(self) -> None:
        """The epoch's end: drain the pipeline, then share every stage's delays and stash bytes (a collective)."""
        if self.segment or self.inflight:  # not just flushed by adapter.flush_every
            with self.meter.span("busy"):
                self._flush()
        mine = {
            "delay_observed": self.observed,
            "stash_bytes": self.stash_peak,
            "flushes": self.flushes,
            "recv_wait_fraction": self.meter.fraction(),
        }
        stats: list = [None] * self.S
        dist.all_gather_object(stats, mine)
        self.stage_stats = stats

    @torch.no_grad()
    def eval_step(self, inputs, targets, weight):
        if self.segment or self.inflight:  # every stage drains (the epoch's end has already, as a rule)
            self._flush()
        with autocast(self.cfg.trainer.precision, self.device):
            h = inputs if self.is_first else self._exchange(self.stage - 1, recvs=[(EVAL, None)])[0]
            out = self.module(h)
        if not self.is_last:
            self._exchange(self.stage + 1, [(out, EVAL)])
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        return self.workload.eval_sums(out, targets, weight)

    def state_bytes(self) -> dict[str, int]:
        out = tensor_bytes(self.modules(), self.optimizer)
        out["stash"] = self.stash_peak  # counted: the peak over the run of the storage the stash held
        out["stash_predicted"] = self.stash_predicted()[self.stage]
        return out

    def stash_predicted(self) -> list[int]:
        """The memory model's stash per stage (its `stash_per_stage`, from this adapter's layout and cost inputs)."""
        from ptbench.core.memory_model import Inputs, ModelFacts, stash_per_stage

        cfg = self.cfg
        inp = Inputs(layout=self.layout(cfg, self.S), cost=self.cost_inputs(cfg), model=ModelFacts(params=0))
        return [int(round(b)) for b in stash_per_stage(inp, [])[0]]

    def describe(self) -> dict:
        a, S = self.cfg.adapter, self.S
        copies = self.stash_copies(self.cfg, S)
        stats = self.stage_stats or []
        return {
            "implementation": "a re-implementation of PipeDream's published semantics (weight stashing, SOSP "
            "2019; PipeDream-2BW, ICML 2021) on torch.distributed point-to-point calls",
            "schedule": a.schedule,
            "stages": S,
            "balance": self.balance,
            "balance_by": "config" if a.balance is not None else "layer_count",
            "microbatches": self.m,
            "micro_batch_size": self.local_batch_size(self.cfg, S) // self.m,
            "update_rule": "w_s(t+1) = w_s(t) - lr * grad f_t(w_s(t - delay_s))",
            "delay_per_stage": self.delays(a.schedule, S, self.m),
            "delay_observed_per_stage": [st["delay_observed"] for st in stats],
            "stash_copies_per_stage": copies,
            "stage_param_bytes": self.stage_param_bytes,
            "stash_bytes_predicted_per_stage": self.stash_predicted(),  # the memory model's
            "stash_bytes_counted_per_stage": [st["stash_bytes"] for st in stats],
            # the bubble as each stage sees it: time waiting for its exchanges / its time in train_step and drains,
            # on the device's stream (CUDA events) on a GPU, host time on gloo; includes fill and drain (and CPU
            # contention when ranks share cores)
            "recv_wait_fraction_per_stage": [st["recv_wait_fraction"] for st in stats],
            "recv_wait_clock": self.meter.clock.name,
            "stash": "no recomputation: torch.func.functional_call on the weights' storage at forward time, "
            "copy on write before a step",
            "flush_every": a.flush_every,
            "flushes": stats[0]["flushes"] if stats else self.flushes,
            "flush_at": "each epoch's end" + (f" and every {a.flush_every} mini-batches" if a.flush_every else ""),
            "batchnorm_buffers": "not stashed: running statistics are live and updated per micro-batch",
            "stage_replication": "refused (one stage per rank)",
            "grad_clip": "per stage" if self.cfg.trainer.grad_clip > 0 else "off",
            "tied_weights": [
                f"{c} on stage {sc} = the version of {mn} stage {sm} used, sent with each mini-batch; its gradient "
                f"is sent back and summed on stage {sm}"
                for mn, c, sm, sc in self.ties
            ],
            # beside the record's comm_volume (activation and gradient sends per micro-batch, as 1F1B): the tied
            # weight goes forward and its gradient back once per mini-batch, point to point (no all-reduce)
            "sends_per_minibatch": {
                "activation": "m per stage boundary, forward",
                "activation_grad": "m per stage boundary, backward",
                "tied_weight_bytes": self.tied_bytes,
                "tied_grad_bytes": self.tied_bytes,
            },
        }


ADAPTER = PipedreamAdapter
