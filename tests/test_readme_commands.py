"""README promises that no other test file covers: sweeps that go on past a failed point, a local Hydra
multirun, `python -m ptbench --help` and `--cfg job`, every paper preset composing, ptbench.studies.overhead, and
training with each optimizer the README lists. Each runs the command a user would type."""

from __future__ import annotations

import argparse
import math
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from ptbench.core.errors import ConfigError
from ptbench.runner.compose import compose, typed
from ptbench.runner.plan import make_plan
from ptbench.runner.points import expand_grid
from tests.helpers import REPO, assert_loss_falls, bench, check_ok, events, run, run_dirs, summary

TINY = ["experiment=smoke", "launcher.nprocs=1", "workload.vocab_size=256", "trainer.max_steps=2"]


def records(root: Path) -> list[dict]:
    return [summary(d) for d in run_dirs(root)]


def test_sweep_goes_on_after_a_failed_first_point(tmp_path):
    """`python -m ptbench.sweep run FILE`: the first point fails at its first step, the second still runs
    and ends ok; the sweep's exit status says a point failed and names it."""
    sweep, root = tmp_path / "sweep.txt", tmp_path / "results"
    sweep.write_text(
        "# first point fails, second must still run\n"
        "'trainer.inject_fault=raise@0\\:0' trainer.seed=1\n"
        "trainer.seed=2\n"
    )
    proc = run(
        [sys.executable, "-m", "ptbench.sweep", "run", str(sweep), "--", *TINY, f"results.root={root}"], timeout=600
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "point 0 (" in proc.stderr and "exited 1" in proc.stderr and "point 1 (" not in proc.stderr, proc.stderr
    got = sorted((s["status"], s.get("failed_rank")) for s in records(root))
    assert got == [("failed", 0), ("ok", None)], got
    assert "[2/2]" in proc.stdout  # the sweep reached its last point
    assert "sweep: 2 run(s): 1 failed, 1 ok" in proc.stdout  # the closing tally


def test_local_multirun_gives_one_ok_record_per_point(tmp_path):
    """`python -m ptbench -m adapter=zero,ddp experiment=smoke` (README: `-m adapter=ddp,zero ...`): two points,
    one after the other on this machine, both ok, in one sweep folder under results.root (nothing in the
    checkout). The multirun process forks both points' ranks: the DDP ranks, started after the ZeRO point,
    carry no DeepSpeed (the launcher imports a framework for its ranks only outside a multirun)."""
    had_multirun = (REPO / "multirun").exists()
    proc = bench("-m", "adapter=zero,ddp", "experiment=smoke", "workload.vocab_size=256", results=tmp_path, timeout=600)
    check_ok(proc)
    assert re.search(r"multirun: 2 record\(s\) in \S+: 2 ok", proc.stdout), proc.stdout[-2000:]  # the tally
    recs = {d: summary(d) for d in run_dirs(tmp_path)}
    assert sorted((s["status"], s["world_size"], s["adapter"]) for s in recs.values()) == [
        ("ok", 2, "ddp"),
        ("ok", 2, "zero"),
    ]
    by_adapter = {s["adapter"]: s for s in recs.values()}
    assert by_adapter["zero"]["frameworks_imported"] == ["deepspeed"]
    assert by_adapter["ddp"]["frameworks_imported"] == [], by_adapter["ddp"]["frameworks_imported"]
    assert by_adapter["ddp"]["plan"]["start_method"] == "fork"
    assert proc.stdout.index(": zero x gpt2_tiny") < proc.stdout.index(": ddp x gpt2_tiny"), (
        proc.stdout
    )  # zero ran first
    folders = {d.parent for d in recs}
    assert len(folders) == 1 and next(iter(folders)).name.startswith("multirun-"), folders
    # the sweep folder holds the records and Hydra's multirun.yaml, no empty per-job 0/ 1/ (issue 31)
    left = sorted(p.name for p in next(iter(folders)).iterdir() if p not in recs)
    assert left == ["multirun.yaml"], left
    assert len({s["point"] for s in recs.values()}) == 2  # two points, two ids
    assert (REPO / "multirun").exists() == had_multirun, "a multirun wrote into the checkout"


def test_help_lists_the_config_groups():
    proc = run([sys.executable, "-m", "ptbench", "--help"], timeout=120)
    check_ok(proc)
    groups = proc.stdout.split("== Configuration groups ==")[1].split("==")[0]
    for group, option in [
        ("adapter", "zero"),
        ("workload", "gpt2_small"),
        ("data", "wikitext2"),
        ("launcher", "torchrun"),
        ("optimizer", "lamb"),
        ("experiment", "paper_language"),
        ("trainer", "default"),
    ]:
        assert re.search(rf"^{group}: .*\b{option}\b", groups, re.M), (group, option, groups)
    # only what a user chooses (issue 31): no adapter schemas, no preset-x-adapter exceptions
    assert "_schema" not in groups and "paper_adapter" not in groups and "experiment_adapter" not in groups, groups
    assert re.search(r"^adapter: ddp, fsdp, gpipe, horovod, megatron, pipedream, pipeline, tensor_parallel, zero, zero1, zero2, zero3$", groups, re.M), groups  # fmt: skip


def test_preset_exceptions_for_one_adapter_still_compose():
    """conf/hydra/experiment_adapter/<experiment>_<adapter>.yaml (out of --help) is still applied: the paper's
    ZeRO runs use Adam, other adapters keep the preset's LAMB; smoke's pipeline splits its batch of 4 in 4."""
    zero = typed(compose(["experiment=paper_language", "adapter=zero2"]))
    assert (zero.optimizer.name, zero.optimizer.lr, zero.optimizer.weight_decay) == ("adam", 1e-3, 0.01)
    assert "Table III" in zero.extra["paper_exception"]
    assert typed(compose(["experiment=paper_language", "adapter=ddp"])).optimizer.name == "lamb"
    assert typed(compose(["experiment=smoke", "adapter=pipeline"])).adapter.microbatches == 4
    assert typed(compose(["adapter=pipeline"])).adapter.microbatches == 0  # outside the preset: the adapter's default


def test_cfg_job_prints_the_resolved_config():
    proc = run([sys.executable, "-m", "ptbench", "--cfg", "job", "adapter=zero", "trainer.batch_size=7"], timeout=120)
    check_ok(proc)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["adapter"]["name"] == "zero" and cfg["trainer"]["batch_size"] == 7
    assert cfg["workload"]["name"] == "gpt2_tiny" and cfg["optimizer"]["name"] == "adamw"  # the defaults
    assert {"workload", "adapter", "data", "launcher", "trainer", "optimizer", "results"} <= set(cfg)


# Paper Table III (Lin et al.), as the README's presets promise: workload, data, optimizer, lr, L2, batch per
# device, epochs
PAPER = {
    "paper_language": ("gpt2_small", "wikitext", "lamb", 1e-3, 0.01, 32, 100),
    "paper_vision": ("resnet50", "imagefolder", "sgd", 0.01, 1e-4, 64, 90),
    "paper_vision_mlperf": ("resnet50", "imagefolder", "lars", 5.0, 1e-4, 128, 90),
}


def test_every_paper_experiment_composes():
    shipped = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("paper_*.yaml"))
    assert set(PAPER) <= set(shipped), shipped  # the README's presets exist
    for name in shipped:  # every preset composes into a typed config and a run plan
        cfg = typed(compose([f"experiment={name}"]))
        assert cfg.results.experiment.startswith("paper_"), name
        plan = make_plan(cfg, "local", world_size=4, check=False)  # the data need not be here to plan a run
        assert plan.global_batch == 4 * cfg.trainer.batch_size  # per device, as the paper scales it
        if name not in PAPER:
            continue
        workload, source, opt, lr, l2, batch, epochs = PAPER[name]
        assert (cfg.workload.name, cfg.data.source, cfg.optimizer.name) == (workload, source, opt), name
        assert math.isclose(cfg.optimizer.lr, lr) and math.isclose(cfg.optimizer.weight_decay, l2), name
        assert (cfg.trainer.batch_size, cfg.trainer.epochs) == (batch, epochs), name


def test_overhead_prints_its_ratio():
    # a small head (vocabulary 256): what is checked is that the harness and the bare loop both ran and were compared
    proc = run(
        [sys.executable, "-m", "ptbench.studies.overhead", "--blocks", "2", "--steps", "3", "workload.vocab_size=256"],
        timeout=600,
    )
    check_ok(proc)
    m = re.search(r"ratio harness/bare = (\S+)", proc.stdout)
    assert m, proc.stdout
    ratio = float(m.group(1))
    assert math.isfinite(ratio) and ratio > 0, ratio  # the number itself is a measurement, not a test
    assert re.search(r"data loading share of harness step time: \d+\.\d%", proc.stdout), proc.stdout


# Eight steps of the smoke run (1 rank, synthetic Markov data) with each optimizer at its shipped settings.
# Measured (2026-11-23, CPU) first -> last loss: lamb 10.846 -> 10.757 (lr 1e-3, the paper's GPT-2 setting,
# moves slowly), lars 10.846 -> 7.886, adam 10.846 -> 10.173. Each must fall by about a third of that.
OPTIMIZERS = {"lamb": 0.03, "lars": 1.0, "adam": 0.2}


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory) -> dict:
    """The three runs as one Hydra multirun (`-m optimizer=adam,lamb,lars`): one launcher start-up, three
    points, each its own ranks; their folders by the optimizer each record's config.yaml names."""
    root = tmp_path_factory.mktemp("optimizers")
    check_ok(
        bench(
            "-m",
            "experiment=smoke",
            "launcher.nprocs=1",
            "trainer.max_steps=8",
            f"optimizer={','.join(sorted(OPTIMIZERS))}",
            results=root,
        )
    )
    return {yaml.safe_load((d / "config.yaml").read_text())["optimizer"]["name"]: d for d in run_dirs(root)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_trains(optimizer_runs, optimizer):
    assert sorted(optimizer_runs) == sorted(OPTIMIZERS)  # one record per point
    run_dir = optimizer_runs[optimizer]
    assert summary(run_dir)["status"] == "ok"
    losses = [x for e in events(run_dir) for x in e["train_losses"]]
    assert len(losses) == 8
    assert_loss_falls(losses, by=OPTIMIZERS[optimizer], what=optimizer)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer"]["name"] == optimizer


# --- every command the README and the reference pages show -------------------------------------------------
# Each command found on a page is checked against the real thing it names: a `python -m ptbench.X` command's
# arguments are parsed by X's own argument parser (stopped right after parsing), a run's overrides compose
# into its typed config, a make target and its variables are in the Makefile, a script, notebook or pip
# extra exists. Running them all would take hours (ledger alone 23 minutes on 2 shared cores); the tests above and the other
# test files run them.
PAGES = ("README.md", "bench/README.md", "analysis/README.md", "adapters/README.md", "slurm/README.md", "results/README.md", "bench/MEASUREMENTS.md")  # fmt: skip
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(?:python -m ptbench|torchrun -m ptbench|make [a-z])[^`]*)`")
# what a page writes for "your value here", and a value of that kind
PLACEHOLDERS = {"N": "2", "i": "0", "DIR": "results/smoke", "FILE": "results/sweep.txt", "<root>": "results"}
DROPPED = {"...", "[overrides]", "<overrides>", "OVERRIDES"}  # "any overrides": none is a valid choice
MAIN_FLAGS = {"-m", "--help", "--cfg", "job", "--plan"}  # Hydra's own, and --plan (bench/__main__.py)
NOT_OURS = {"srun", "sinfo", "export", "unset", "mkdir"}  # Slurm's and the shell's: nothing of ours to check


def page_commands(page: str) -> list[str]:
    """The commands of a page: every line of its ```bash blocks (comments cut, continuations joined), and
    every inline `python -m ptbench...`, `torchrun -m ptbench...` and `make ...` of its prose."""
    text = (REPO / page).read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line := re.sub(r"(^|\s+)#.*$", "", line).strip():
                cmds.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    return cmds + [" ".join(m.split()) for m in INLINE.findall(prose)]


def words(cmd: str) -> list[str]:
    """The command's words with the page's placeholders filled in and optional brackets opened."""
    out = []
    for w in shlex.split(cmd):
        if w in DROPPED:
            continue
        w = w.strip("[]")
        out += [PLACEHOLDERS.get(w, w).replace("<experiment>", "smoke")] if w else []
    return out


class _Parsed(Exception):
    pass


def parse_only(module: str, args: list[str], monkeypatch) -> None:
    """Run `python -m MODULE ARGS` in this process up to its argument parser, and stop there. A parser error
    (an unknown or malformed flag) is argparse's own exit 2."""
    real_known, depth = argparse.ArgumentParser.parse_known_args, [0]

    def known(self, args=None, namespace=None):  # also called by a subcommand's parser: stop at the outer one
        depth[0] += 1
        try:
            got = real_known(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0]:
            return got
        raise _Parsed(got)

    def full(self, args=None, namespace=None):
        try:
            known(self, args, namespace)
        except _Parsed as parsed:
            if parsed.args[0][1]:
                self.error(f"unrecognized arguments: {' '.join(parsed.args[0][1])}")
            raise

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", full)
    monkeypatch.setattr(sys, "argv", [module, *args])
    monkeypatch.delitem(sys.modules, module, raising=False)  # run as __main__, not beside its imported copy
    with pytest.raises(_Parsed):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def check_overrides(overrides: list[str]) -> None:
    for point in expand_grid(overrides) if overrides else [[]]:
        typed(compose(point))


def check_make(args: list[str]) -> None:
    makefile = (REPO / "Makefile").read_text()
    target, variables = args[0], [a.split("=")[0] for a in args[1:]]
    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}: no such target"
    for var in variables:
        assert f"$({var})" in makefile or re.search(rf"^{var}\s*\??=", makefile, re.M), f"make: {var} unused"


def check_pip(args: list[str]) -> None:
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    asked = [x for a in args if "[" in a for x in a.split("[")[1].rstrip("]").split(",")]
    assert asked and set(asked) <= extras, (args, sorted(extras))


PARSED_BY = {"ptbench.compare": "ptbench.analysis.compare"}


def check_command(cmd: str, monkeypatch) -> None:
    w = words(cmd)
    while w and re.match(r"^[A-Z_]+=", w[0]):  # VAR=value before the command
        w.pop(0)
    prog = w[0].removeprefix(".venv/bin/")
    if prog in ("python", "torchrun") and w[1:3] in (["-m", "ptbench"], ["-m", "bench"]):
        assert w[2] == "ptbench", cmd
        check_overrides([a for a in w[3:] if a not in MAIN_FLAGS])
    elif prog == "python" and w[1] == "-m" and w[2] == "ptbench.runner.launch":
        from ptbench.runner.launch import main

        assert main([*w[3:], "adapter=megatron", "adapter.tensor_parallel=2"]) == 0, cmd
    elif prog == "python" and w[1] == "-m" and w[2] == "ptbench.core.schema":
        from ptbench.core.schema import markdown, readme_block

        assert readme_block((REPO / w[3]).read_text()) == markdown().strip("\n"), cmd  # it would change nothing
    elif prog == "python" and w[1] == "-m" and w[2].startswith("ptbench."):
        # ptbench.compare hands its arguments to the analysis package's parser, in a process of its own
        parse_only(PARSED_BY.get(w[2], w[2]), w[3:], monkeypatch)
    elif prog == "make":
        check_make(w[1:])
    elif prog == "pip":
        check_pip(w[1:])
    elif prog == "bash" and w[1].endswith("/install.sh"):  # a wheelhouse's own: make wheelhouse writes it
        assert "> $(WHEELHOUSE)/install.sh" in (REPO / "Makefile").read_text(), cmd
        assert (REPO / ".ci" / "wheelhouse_install.sh").is_file(), cmd
    elif prog == "bash" or prog == "sbatch":
        script = next(a for a in w if a.startswith("slurm/"))
        assert (REPO / script).is_file(), cmd
        if prog == "bash":
            source = (REPO / script).read_text()
            assert all(f"{a})" in source or a in source for a in w[2:]), cmd  # its subcommand and options
        elif script.endswith("run.sbatch"):
            check_overrides(w[w.index(script) + 1 :])
    elif prog in ("jupyter", "papermill"):
        assert all((REPO / a).exists() for a in w if a.startswith("analysis/")), cmd
    else:
        assert prog in NOT_OURS, f"{cmd}: a command of a kind this test does not check; teach check_command it"


@pytest.mark.parametrize("page", PAGES)
def test_every_command_on_the_page_is_real(page, monkeypatch):
    cmds = list(dict.fromkeys(page_commands(page)))
    assert len(cmds) >= 3, cmds  # the extraction found the page's commands
    failed = []
    for cmd in cmds:
        try:
            with monkeypatch.context() as m:
                check_command(cmd, m)
        except (AssertionError, ConfigError, ImportError, SystemExit, pytest.fail.Exception) as e:
            failed.append(f"{cmd}: {type(e).__name__} {e}")
    assert not failed, "\n".join(failed)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_lands(page):
    """A relative link of a page names a file of the checkout and, after '#', one of that file's headings."""
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / page).read_text())
    broken = []
    for link in (x for x in links if "://" not in x):
        path, _, anchor = link.partition("#")
        target = (REPO / page).parent / path if path else REPO / page
        if not target.exists() or (anchor and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, f"{page}: {broken}"
