"""Samplers and loaders shared by every adapter.

Training: `StepShardedSampler` is a DistributedSampler (same seed + epoch shuffle, `set_epoch`) that
deals each optimizer step's global batch in contiguous slices: with G = replicas x batch, step k of
every world size covers perm[kG:(k+1)G], and replica r reads its slice r. So a 2-replica run sees
exactly the micro-batches that a 1-replica run with 2 accumulation steps sees, which makes runs at
different scales compare sample for sample (BatchNorm statistics included). Incomplete last global
batches are dropped, so every step has the same size. `set_position(epoch, step)` resumes an epoch
at a step (checkpoints, bench/core/checkpoint.py): the same shuffle, the steps before it skipped.

Validation: every sample is counted exactly once. Ranks get equal-length strided shards (so
frameworks that gather parameters in forward, like ZeRO-3/FSDP, never hang on uneven counts);
the padding repeats samples with weight 0, so they do not inflate any metric.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class StepShardedSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, grad_accum: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.micro = batch_size
        self.accum = grad_accum
        global_batch = batch_size * grad_accum * num_replicas
        self.steps = len(dataset) // global_batch
        self.num_samples = self.steps * batch_size * grad_accum
        self.start_step = 0  # resume: the epoch's first steps already done (set_position)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start_step = 0

    def set_position(self, epoch: int, step: int) -> None:
        """Resume inside an epoch: the same shuffle, from its step `step` (those before were trained)."""
        super().set_epoch(epoch)
        self.start_step = step

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=g).tolist()
        per_replica = self.micro * self.accum
        global_batch = per_replica * self.num_replicas
        for k in range(self.start_step, self.steps):
            start = k * global_batch
            # micro-batch j of replica r is slice (j * replicas + r): the same micro-batches that one
            # replica with replicas x accum accumulation steps would see, in the same order.
            for j in range(self.accum):
                s = start + (j * self.num_replicas + self.rank) * self.micro
                yield from perm[s : s + self.micro]

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.micro * self.accum


class WeightedEvalSet(Dataset):
    """The validation set padded to `length` items; padded items carry weight 0."""

    def __init__(self, dataset: Dataset, length: int):
        self.dataset = dataset
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        n = len(self.dataset)
        x, y = self.dataset[i % n]
        return x, y, torch.tensor(1.0 if i < n else 0.0)


class StridedSampler(Sampler):
    def __init__(self, length: int, rank: int, replicas: int):
        self.indices = list(range(rank, length, replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def data_workers(requested: int | None, local_world_size: int, env=None) -> int:
    """DataLoader workers per rank: `requested`, else from the CPUs this rank may use (Slurm's
    SLURM_CPUS_PER_TASK, else the node's CPUs shared by its ranks) minus the rank's own, at most 8."""
    import os

    if requested is not None:
        return requested
    env = os.environ if env is None else env
    cpus = int(env.get("SLURM_CPUS_PER_TASK") or 0) or (os.cpu_count() or 1) // max(1, local_world_size)
    return max(0, min(8, cpus - 1))


def loader_options(device_type: str, workers: int) -> dict:
    """DataLoader settings from the device type (a pure function: the CPU twin tests pass "cuda").

    pin_memory on CUDA: batches land in page-locked memory, so the copy to the GPU is asynchronous
    (`non_blocking=True` in the trainer); pointless on CPU. persistent_workers whenever there are
    workers: they, and a decoded-image cache in them, survive from one epoch to the next."""
    return {"pin_memory": device_type == "cuda", "persistent_workers": workers > 0}


def ignore_interrupt(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C to their rank: a Ctrl-C to the process group reaches every worker too,
    and a worker that quit on it would fail the rank's next batch instead of letting it stop at a step's end."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerDied(RuntimeError):
    """A DataLoader worker of this rank ended while the rank waited for its batch (a signal: the OOM
    killer, a kill from outside; or an exit), named by worker id, pid and signal."""


class Loader(DataLoader):
    """A DataLoader whose multi-process iterator names a worker that died: torch reports it as a
    ConnectionResetError, an EOFError or "worker (pid(s) N) exited unexpectedly", depending on which of its
    checks sees the death first; this one waits for the dead worker's exit status and says which worker,
    which pid and which signal (`WorkerDied`)."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        return _watched_iterator(self)


def _watched_iterator(loader: DataLoader):
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    class WatchedIterator(_MultiProcessingDataLoaderIter):
        def _next_data(self):
            try:
                return super()._next_data()
            except (OSError, EOFError, RuntimeError) as e:  # how torch sees a worker's death (not StopIteration)
                # a worker's own exception comes re-raised with its traceback ("Caught ..."): no death to wait for
                dead = dead_worker(self._workers, wait_s=0.0 if "Caught " in str(e) else 5.0)
                if dead is None:
                    raise
                self._shutdown_workers()  # the others, and torch's SIGCHLD check of them, end here
                raise WorkerDied(dead) from e

    return WatchedIterator(loader)


def dead_worker(workers, wait_s: float = 5.0) -> str | None:
    """One line on the first of `workers` (multiprocessing.Process, index = worker id) that died (a signal,
    a nonzero exit), or None. A worker killed by a signal closes its pipes a moment before it can be
    reaped: wait for that, at most `wait_s` seconds."""
    import signal
    import time

    deadline = time.monotonic() + wait_s
    while True:
        ended = [(i, w) for i, w in enumerate(workers) if w.exitcode not in (None, 0)]  # 0: shut down
        if ended or time.monotonic() > deadline:
            break
        try:
            time.sleep(0.01)
        except RuntimeError:  # torch's SIGCHLD handler raises "worker ... is killed by signal" wherever it runs
            pass
    if not ended:
        return None
    worker_id, w = ended[0]
    if w.exitcode < 0:
        how = f"was killed by signal {signal.Signals(-w.exitcode).name} ({signal.strsignal(-w.exitcode)})"
        hint = "the OOM killer sends SIGKILL when memory runs out (see dmesg): lower data.num_workers"
    else:
        how, hint = f"exited with code {w.exitcode}", "its dataset or transform ended the process"
    return f"DataLoader worker {worker_id} (pid {w.pid}) {how} while loading a batch; {hint}"


def train_loader(
    dataset: Dataset,
    replicas: int,
    rank: int,
    batch_size: int,
    grad_accum: int,
    seed: int,
    workers: int,
    device_type: str | None = None,
):
    sampler = StepShardedSampler(dataset, replicas, rank, batch_size, grad_accum, seed)
    loader = Loader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        worker_init_fn=ignore_interrupt if workers else None,
        **loader_options(device_type or _device_type(), workers),
    )
    return loader, sampler


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def eval_loader(dataset: Dataset, replicas: int, rank: int, batch_size: int, workers: int, max_batches: int = 0):
    n = len(dataset)
    if max_batches > 0:
        n = min(n, max_batches * batch_size * replicas)
    per_rank = math.ceil(n / replicas)
    padded = WeightedEvalSet(torch.utils.data.Subset(dataset, range(n)), per_rank * replicas)
    return Loader(
        padded,
        batch_size=batch_size,
        sampler=StridedSampler(len(padded), rank, replicas),
        num_workers=workers,
        worker_init_fn=ignore_interrupt if workers else None,
        pin_memory=loader_options(_device_type(), workers)["pin_memory"],
    )
