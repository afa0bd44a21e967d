"""`python -m bench [hydra overrides]`: run one benchmark point (or a sweep with -m)."""
from __future__ import annotations

import os
import signal
import sys

# Hold preemption signals from the very start: they are unblocked where they can be honoured (the
# local launcher forwards them to its ranks; a rank turns them into a graceful stop), so a signal
# that arrives while Python is still importing torch is not fatal.
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGTERM))

# Before torch is imported anywhere: one thread per rank on CPU (ranks share the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# submitit (hydra/launcher=submitit_*) asks Slurm for its time-limit signal and handles it itself;
# make that USR1, the signal the ranks turn into a graceful stop (read at submitit's import).
os.environ.setdefault("SUBMITIT_PREEMPT_SIGNAL", "USR1")

# Hydra takes launchers only from the `hydra_plugins` namespace package; ours lives in
# bench/plugins/hydra_plugins/ (no __init__.py, so it merges with the installed plugins).
# PYTHONPATH too: submitit's job processes unpickle the launcher's callable and need the module.
_PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
sys.path.append(_PLUGINS)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(_paths if _PLUGINS in _paths else [*_paths, _PLUGINS])  # nested runs add it once

import warnings  # noqa: E402

# conf/hydra/launcher/submitit_*.yaml share their names with the plugin's schemas on purpose (Hydra
# then type-checks them against those); Hydra 1.3 warns that this matching is deprecated.
warnings.filterwarnings("ignore", message=r"(?s).*validated against ConfigStore schema with the same name")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from bench.config import register_configs  # noqa: E402
from bench.errors import ConfigError  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> int:
    from bench.sweep import apply_hydra_context, skip_if_done

    apply_hydra_context(cfg)  # sweep point id; a multirun's records go to its sweep folder
    if skip_if_done(cfg):
        return 0
    from bench.run import launch

    try:
        code = launch(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if code and not _in_multirun():
        sys.exit(code)
    return code


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().mode.name == "MULTIRUN"
    except ValueError:
        return False


def main() -> None:
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        # a sweep's parent only submits and waits (its points block and unblock for themselves)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGUSR1, signal.SIGTERM))
    _hydra_main()


if __name__ == "__main__":
    main()
