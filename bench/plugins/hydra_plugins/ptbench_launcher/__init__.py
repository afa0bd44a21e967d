"""The Hydra launchers behind `python -m ptbench -m hydra/launcher=bench_slurm ...` and
`hydra/launcher=ptbench_local`.

Hydra only instantiates launchers from the `hydra_plugins` namespace package: this package is
installed as `hydra_plugins.ptbench_launcher` (pyproject.toml maps it from
bench/plugins/hydra_plugins/), Hydra's documented plugin layout, so it is found with no
sys.path or PYTHONPATH edits. conf/hydra/launcher/bench_slurm.yaml names this class as
`_target_` and extends the stock plugin's schema (`submitit_slurm`) in its defaults list, with
`gpus_per_node` meaning the GPUs of one node of the cluster.

Why not the stock submitit Slurm launcher as is: it submits the whole sweep as one job array, and
Slurm gives every task of an array the same resources, while benchmark points differ in rank
count (the paper's 1..64 GPUs). This one composes each point's config, asks its adapter how many
ranks it needs, and submits one array per allocation shape: one Slurm task per rank, spread over
nodes by `gpus_per_node`. Every task runs the Hydra job (`python -m ptbench`'s task function), which
sees SUBMITIT_EXECUTOR=slurm and becomes the rank SLURM_PROCID of the point (bench/runner/launch.py).

Hydra imports every module of `hydra_plugins` in every Hydra app of the environment (its plugin scan), so
this one only adds names of its own: `ptbench_local` in Hydra's ConfigStore, and the two launcher classes.
The stock plugin's `submitit_local` and `submitit_slurm` stay as that plugin defines them for every app,
ptbench included.
"""

import contextlib
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides

from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

log = logging.getLogger(__name__)


@contextlib.contextmanager
def reporting_wait(what: str, folder: Path, total: int, every: float = 30.0):
    """While a launcher waits for its points: one line when it starts and one every `every` s, with the points
    whose result submitit has written under `folder` (slow can be told from hung)."""
    from ptbench.core.stopping import helper_thread  # a stop signal is the sweep's main thread's to forward

    folder = Path(str(folder).split("%j")[0])  # submitit's folder up to the job id
    stop, t0 = threading.Event(), time.monotonic()

    def report() -> None:
        while not stop.wait(every):
            done = len(list(folder.glob("**/*_result.pkl")))
            print(
                f"{what}: {done} of {total} point(s) finished after {time.monotonic() - t0:.0f} s; "
                f"waiting (job logs in {folder})",
                flush=True,
            )

    print(f"{what}: waiting for {total} point(s) (job logs in {folder})", flush=True)
    thread = helper_thread(report, "reporting-wait")
    try:
        yield
    finally:
        stop.set()
        thread.join()


class BenchSlurmLauncher(SlurmLauncher):
    def _shape(self, overrides: Sequence[str]) -> tuple[int, int, int | None]:
        from ptbench.runner.points import layout_of
        from ptbench.runner.slurm import slurm_shape

        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        if "adapter" not in cfg:  # another Hydra app's job (Hydra's launcher test suites): sized as submitit_slurm does
            return self.params["nodes"], self.params["tasks_per_node"], self.params.get("gpus_per_node")
        ranks, devices = layout_of(cfg)
        return slurm_shape(ranks, devices, self.params.get("gpus_per_node"))

    def _executor(self, nodes: int, tasks_per_node: int, gpus_per_node: int | None) -> Any:
        import submitit

        params = dict(self.params)
        folder = params.pop("submitit_folder")
        executor = submitit.AutoExecutor(
            cluster="slurm", folder=folder, slurm_max_num_timeout=params.pop("max_num_timeout", 0)
        )
        params.update(nodes=nodes, tasks_per_node=tasks_per_node, gpus_per_node=gpus_per_node)
        shared = {f.name for f in dataclasses.fields(BaseQueueConf)}
        executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"submitit 'slurm' sweep output dir: {sweep_dir}")
        by_shape: dict[tuple, list[tuple[int, list[str]]]] = defaultdict(list)
        for num, overrides in enumerate(job_overrides, initial_job_idx):
            by_shape[self._shape(overrides)].append((num, list(overrides)))
        # Submit every shape's array first, then wait: the points run concurrently.
        submitted = []
        for (nodes, tasks, gpus), points in by_shape.items():
            for num, overrides in points:
                log.info(f"\t#{num} ({nodes} node(s) x {tasks} task(s)): {' '.join(filter_overrides(overrides))}")
            nums = [num for num, _ in points]
            jobs = self._executor(nodes, tasks, gpus).map_array(
                self,
                [o for _, o in points],
                ["hydra.sweep.dir"] * len(points),
                nums,
                [f"job_id_for_{n}" for n in nums],
                [Singleton.get_state()] * len(points),
            )
            submitted += zip(nums, jobs)
        # Rank 0's return is the point's result (every task returns one).
        with reporting_wait("bench_slurm", Path(str(self.params["submitit_folder"])), len(submitted)):
            return [job.results()[0] for _, job in sorted(submitted, key=lambda item: item[0])]


class BenchLocalLauncher(LocalLauncher):
    """`hydra/launcher=ptbench_local`: the stock submitit local launcher (`submitit_local`), but at most
    `array_parallelism` points at a time, 1 by default: timing points that run side by side share the cores and
    their times do not compare (steps measured 1.7-2.7x slower on 2 cores). Raise it
    (hydra.launcher.array_parallelism=N) for runs whose times you do not compare; their records then carry
    `contention:` warnings (bench/runner/contention.py)."""

    def __init__(self, **params: Any) -> None:
        parallel = params.pop("array_parallelism", 1)
        super().__init__(**params)
        if not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"hydra.launcher.array_parallelism={parallel} must be an integer >= 1")
        self.parallel = parallel

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ptbench.runner import multirun

        assert self.config is not None
        out: list[JobReturn] = []
        waiting = reporting_wait("ptbench_local", Path(str(self.params["submitit_folder"])), len(job_overrides))
        with waiting, multirun.forwarding_to_jobs():  # Ctrl-C / SIGTERM: the running points stop, no other starts
            for start in range(0, len(job_overrides), self.parallel):  # each batch ends before the next starts
                batch = job_overrides[start : start + self.parallel]
                try:
                    out += super().launch(batch, initial_job_idx + start)
                except Exception:  # a point's job ended by the signal may leave no result: the records say
                    if not multirun.received():
                        raise
                if multirun.received():
                    nums = ", ".join(
                        f"#{n}" for n in range(initial_job_idx + start, initial_job_idx + start + len(batch))
                    )
                    multirun.stop(f"during point(s) {nums}: their records are final", self.config.hydra.sweep.dir)
        return out


@dataclasses.dataclass
class BenchLocalQueueConf(LocalQueueConf):
    """The stock `submitit_local` schema plus `array_parallelism` (points at a time, 1 by default)."""

    _target_: str = "hydra_plugins.ptbench_launcher.BenchLocalLauncher"
    array_parallelism: int = 1
    # no `%j` folder level: submitit names every file by its job id, and for local jobs it would also leave an
    # empty folder literally named `%j`
    submitit_folder: str = "${hydra.sweep.dir}/.submitit"


# A schema node rather than a yaml beside bench_slurm's: the stock LocalQueueConf has no array_parallelism, and a
# yaml extending it could not add the field. Under ptbench's own name: any Hydra app in the environment can pick
# it, and none that asks for `submitit_local` gets it instead of the stock launcher.
ConfigStore.instance().store(
    group="hydra/launcher", name="ptbench_local", node=BenchLocalQueueConf, provider="ptbench_launcher"
)
