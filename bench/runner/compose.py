"""The config tree: where conf/ is, the schemas Hydra checks it against, and composing it.

Used by `python -m ptbench` (Hydra's main) and by every driver that needs a point's config without
running it (sweep, overhead, memory study), so the Hydra boilerplate is written once.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ptbench.adapters.configs import SCHEMAS, store_schemas
from ptbench.core.config import BenchConfig, store_schema
from ptbench.core.errors import ConfigError


def conf_dir() -> Path:
    """conf/ of a source checkout (beside bench/), else the copy a wheel ships as bench/conf."""
    here = Path(__file__).resolve().parents[1]  # bench/
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"no conf/config.yaml beside {here} or inside it: reinstall ptbench (pip install .)")


def visible_gpus(default: int = 0) -> int:
    """GPUs this process can use (torch reads NVML, no CUDA context), else `default`."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else int(default)


def register_configs() -> None:
    """The whole tree's schema and each adapter's own (group `adapter`), and the resolver
    `${visible_gpus_or:2}` (conf/launcher/local.yaml: one rank per GPU, 2 ranks on a CPU)."""
    cs = ConfigStore.instance()
    store_schema(cs)
    store_schemas(cs)
    if not OmegaConf.has_resolver("visible_gpus_or"):
        OmegaConf.register_new_resolver("visible_gpus_or", lambda default: visible_gpus(default) or int(default))


def in_multirun() -> bool:
    """This process runs a Hydra multirun (`python -m ptbench -m ...`): one point after another in it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# Config keys renamed so that no two say the same word for different things: the lr schedule
# group beside adapter.schedule (a pipeline schedule), untimed steps beside lr_schedule.warmup, skipping a
# finished point beside trainer.resume. An old key is refused with the new name, before Hydra sees it.
RENAMED = {
    "schedule": "lr_schedule",
    "trainer.warmup_steps": "trainer.untimed_steps",
    "results.resume": "results.skip_done",
}


def renamed_key(override: str) -> str | None:
    """The one-line refusal of an override that uses a renamed key, else None."""
    key = override.split("=", 1)[0].lstrip("+~")
    for old, new in RENAMED.items():
        if key == old or key.startswith(old + "."):
            new_key = new + key[len(old) :]
            return f"{key} was renamed {new_key}: write {override.replace(key, new_key, 1)}"
    return None


# Keys whose value names one folder of a record's path (results.root/results.experiment/results.run_id):
# one path component each, so that a record always lands inside results.root.
FOLDER_KEYS = ("results.experiment", "results.run_id")


def check_record_paths(cfg) -> None:
    """One line per key that names a folder but is not a single path component (a separator, "." or
    "..", an absolute path, empty): the record would land outside results.root."""
    import os

    for key in FOLDER_KEYS:
        value = OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else _select(cfg, key)
        if value is None and key == "results.run_id":
            continue  # generated
        text = str(value)
        seps = {os.sep, "/", "\\"} | ({os.altsep} if os.altsep else set())
        bad = (
            "is empty"
            if not text.strip()
            else "is a path, not a folder name"
            if any(c in text for c in seps) or text in (".", "..") or Path(text).is_absolute()
            else "holds a control character"
            if any(ord(c) < 32 for c in text)
            else None
        )
        if bad:
            raise ConfigError(
                f"{key}={text} {bad}: it names one folder under results.root; use a plain name such as "
                f"{key}=my_{key.rsplit('.', 1)[-1]} (put the records elsewhere with results.root=PATH)"
            )


def _select(d, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def compose(overrides: list[str]) -> DictConfig:
    """The config `python -m ptbench <overrides>` would run (no torch import). Hydra's error, if any, as
    one-line ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    for override in overrides:
        if refusal := renamed_key(override):
            raise ConfigError(refusal)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(one_line(e)) from None
    check_record_paths(cfg)
    return cfg


def one_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's messages span lines (the key, full_key, object_type, the options, a hint
    about stack traces): one line that names the key and the fix. A key the chosen adapter does not
    have names the adapters that do."""
    cause = e.__cause__ or e
    lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    meta = dict(ln.split("=", 1) for ln in lines[1:] if "=" in ln and ":" not in ln.split("=", 1)[0])
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    head = str(e).strip().splitlines()[0]
    if cause is e:
        if "Could not find" in head:  # an unknown group option: list the options, not the search path
            options = [ln.strip() for ln in str(e).splitlines() if ln.startswith("\t") and "=" not in ln]
            return f"{head}; choose one of: {', '.join(options)}" if options else head
        return head
    override = head.removeprefix("Error merging override ") if head.startswith("Error merging override ") else ""
    text = f"{override or full_key or head}: {lines[0]}"
    key = full_key.rsplit(".", 1)[-1]
    if full_key.startswith("adapter.") and "not in" in lines[0]:
        chosen = next((n for n, s in SCHEMAS.items() if s.__name__ == meta.get("object_type")), None)
        owners = [n for n, s in SCHEMAS.items() if key in s.__dataclass_fields__]
        if chosen:
            keys = ", ".join(f for f in SCHEMAS[chosen].__dataclass_fields__ if f != "name")
            text = f"{full_key} is not a key of adapter={chosen} (its keys: {keys})"
            if owners:
                text += f"; it belongs to adapter={' / adapter='.join(owners)}: choose that adapter"
    elif "not in" in lines[0]:
        text += " (misspelt? `python -m ptbench --cfg job` prints every key)"
    return text


def typed(cfg_dict) -> BenchConfig:
    """A resolved config (dict or DictConfig) merged into its schema, for typed attribute access. One that is
    typed already is returned as it is: a process types its config once, however many callers ask."""
    name = cfg_dict["adapter"]["name"]
    check_record_paths(cfg_dict)
    if name not in SCHEMAS:
        raise ConfigError(f"unknown adapter '{name}': choose one of {', '.join(sorted(SCHEMAS))} (adapter=NAME)")
    if (
        OmegaConf.is_config(cfg_dict)
        and OmegaConf.get_type(cfg_dict) is BenchConfig
        and OmegaConf.get_type(cfg_dict, "adapter") is SCHEMAS[name]
    ):
        return cfg_dict
    base = OmegaConf.structured(BenchConfig(adapter=SCHEMAS[name]()))
    return OmegaConf.merge(base, cfg_dict)  # type: ignore[return-value]
