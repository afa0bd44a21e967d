"""`python -m ptbench [hydra overrides]`: run one benchmark point (or a sweep with -m)."""

from __future__ import annotations

import os
import signal
import sys

if __package__ == "bench":  # `python -m bench` in a checkout: the command's name before the namespace
    sys.exit("error: `python -m bench` is now `python -m ptbench` (or the `ptbench` command); see README.md")

# Hold preemption signals from the very start: they are unblocked where they can be honoured (the
# local launcher forwards them to its ranks; a rank turns them into a graceful stop), so a signal
# that arrives while Python is still importing torch is not fatal.
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGTERM))

# Before torch is imported anywhere: the CPUs Slurm gave this task, else one thread per rank (ranks
# share the cores); each rank sets launcher.threads_per_rank once it runs (bench/core/dist.py).
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK") or "1")
# submitit (hydra/launcher=submitit_* and bench_slurm) asks Slurm for its time-limit signal and
# handles it itself; make that USR1, the signal the ranks turn into a graceful stop (read at import).
os.environ.setdefault("SUBMITIT_PREEMPT_SIGNAL", "USR1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ptbench.core.errors import ConfigError  # noqa: E402
from ptbench.runner.compose import compose, conf_dir, in_multirun, register_configs  # noqa: E402

register_configs()

# Hydra's own flags that print or inspect instead of running: Hydra handles them
_HYDRA_FLAGS = {
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "-p",
    "--package",
    "--resolve",
    "--shell-completion",
    "-sc",
    "--version",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
}


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    from ptbench.runner.points import apply_hydra_context, skip_if_done

    apply_hydra_context(cfg)  # sweep point id; a multirun's records go to its sweep folder
    if skip_if_done(cfg):
        return 0
    from ptbench.runner.launch import launch

    try:
        code = launch(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except OSError as e:  # a folder or file the run needs that cannot be written or read: one line, no traceback
        where = e.filename or cfg.results.root
        print(
            f"error: {where}: {e.strerror or e}: check that path (results.root={cfg.results.root} must be a "
            "writable folder with free space)",
            file=sys.stderr,
        )
        code = 1
    except KeyboardInterrupt:  # Ctrl-C before a record existed (one that exists ends `interrupted`)
        print("interrupted (Ctrl-C) before the run started: nothing recorded", file=sys.stderr)
        code = 130
    if code and not in_multirun() or code == 130:  # Ctrl-C ends a sweep too, not only its current point
        sys.exit(code)
    return code


def _precheck(argv: list[str]) -> None:
    """A single run's overrides composed first, so a bad key or value is one line (Hydra's own message
    spans several, with a hint about stack traces) and exit 2, before Hydra or any rank starts."""
    if set(argv) & _HYDRA_FLAGS or any(a.split("=")[0] in _HYDRA_FLAGS for a in argv):
        return
    try:
        compose(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _plan(argv: list[str]) -> int:
    """`python -m ptbench --plan <overrides>`: the run plan and the predicted memory per rank
    (bench/core/memory_model/) against this machine's device memory, and the comm volume per step; no
    rank starts. The launcher's own `plan_run` computes them, so this prints what a run would record."""
    from ptbench.core.memory_model import GIB, table
    from ptbench.runner.compose import typed
    from ptbench.runner.plan import plan_run

    try:
        plan, pred = plan_run(typed(compose(argv)), "local", check=False, refuse=False)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if pred is None:
        print(f"error: {plan.predicted_memory['error']}", file=sys.stderr)
        return 2
    d = plan.describe()
    print(
        f"plan: adapter={d['adapter']} workload={d['workload']} ranks={d['world_size']} devices={d['devices']} "
        f"dp={d['dp_size']} microbatches={d['microbatches']} local_batch={d['local_batch']} "
        f"global_batch={d['global_batch']} precision={d['precision']}"
    )
    print(table(pred))
    mem, vol = plan.predicted_memory, plan.comm_volume
    if mem["device_bytes"] is None:
        print("device memory: unknown (no check)")
    else:
        verdict = (
            "fits"
            if mem["fits"]
            else (
                "does NOT fit (refused: trainer.memory_check=refuse)"
                if typed(compose(argv)).trainer.memory_check == "refuse"
                else "does NOT fit (a warning; trainer.memory_check=refuse refuses)"
            )
        )
        print(
            f"device memory: {mem['device_bytes'] / GIB:.2f} GiB ({mem['device']}); predicted "
            f"{pred['total'] / GIB:.3f} GiB per rank {verdict} within 90 %"
        )
    if "error" in vol:
        print(f"comm volume: not modelled ({vol['error']})")
    else:
        ops = ", ".join(f"{op} {b / 2**20:.2f}" for op, b in vol["by_op"].items()) or "no collectives"
        print(
            f"comm volume per optimizer step per rank: {vol['total_bytes'] / 2**20:.2f} MiB ({ops} MiB; "
            f"backend {vol['backend']})"
        )
    return 0


def main() -> None:
    argv = sys.argv[1:]
    if "--plan" in argv:
        sys.exit(_plan([a for a in argv if a != "--plan"]))
    if {"-m", "--multirun"} & set(argv):
        # a sweep's parent only submits and waits (its points block and unblock for themselves)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGUSR1, signal.SIGTERM))
    else:
        _precheck(argv)
    _hydra_main()


if __name__ == "__main__":
    main()
