"""A sweep file lists points: a line that sets a hydra.* key, calls a resolver, names a config by path or passes a
Hydra option is refused in one line by every reader (`sweep run`, `submit`, `point` for slurm/array.sbatch, and
`grid` for what it writes), unless the reader passes --trust-sweep-file.

The attacks are real: a second uid (tests/conftest.py `two_users`) writes the sweep file, a pickle and a
sitecustomize.py into a folder of its own in a group folder; the victim is the test's own user (the venv's
interpreter lies in a folder only root may enter, so another uid cannot start the runs a sweep starts). What ran
is proven by the marker files the planted code writes.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run, run_dirs

FLAG, ENV = "--trust-sweep-file", "PTBENCH_TRUST_SWEEP_FILE"
ARRAY = REPO / "slurm" / "array.sbatch"
TOKEN = "s3cret-token-41"
# the smallest real run; every hostile line is one point of such a sweep
POINT = ["experiment=smoke", "launcher.nprocs=1", "trainer.max_steps=2", "workload.vocab_size=256"]
SUFFIX = f"; a sweep line names a point only: if you wrote this file and mean it, pass {FLAG} (array tasks: {ENV}=1)"


class _Payload:
    """A pickle that, loaded, writes `marker`: code of the attacker's choosing runs in the loader."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pickle loaded')",)


def plant(users) -> Path:
    """The attacker's own folder in a group folder, holding evil.pkl and site/sitecustomize.py (each writes a
    marker in users.base when its code runs); returns the folder."""
    evil = users.shared(users.base / "group") / "attacker"
    write = 'mkdir -p "$1/site" && cat > "$1/evil.pkl" && printf "%s\\n" "$2" > "$1/site/sitecustomize.py"'
    site = f"open({str(users.base / 'site-ran')!r}, 'w').write('sitecustomize imported')"
    subprocess.run(
        users.attacker("sh", "-c", write, "sh", str(evil), site),
        input=pickle.dumps(_Payload(users.base / "pickle-ran")),
        check=True,
        env=users.env(),
        timeout=60,
    )
    assert evil.stat().st_uid == users.ATTACKER
    return evil


def attacker_writes(users, path: Path, text: str) -> Path:
    subprocess.run(
        users.attacker("sh", "-c", 'cat > "$1"', "sh", str(path)), input=text.encode(), check=True, timeout=60
    )
    return path


# line, the start of its refusal (after `FILE:1: `); what each did before: see the test's docstring
ATTACKS = {
    "callback": (
        "+hydra.callbacks.x._target_=torch.load +hydra.callbacks.x.f={evil}/evil.pkl "
        "+hydra.callbacks.x.weights_only=false",
        "key hydra.callbacks.x._target_: a hydra.* key",
    ),
    "env_set": ("+hydra.job.env_set.PYTHONPATH={evil}/site", "key hydra.job.env_set.PYTHONPATH: a hydra.* key"),
    "oc_env": (
        "results.experiment=leak-${{oc.env:PTBENCH_TEST_TOKEN}}",
        "key results.experiment: its value calls the resolver oc.env",
    ),
}


def proof(users, results: Path) -> list[str]:
    """What the attack did: the planted code's markers, and any folder under results naming the token."""
    ran = [f"{m}: {(users.base / m).read_text()}" for m in ("pickle-ran", "site-ran") if (users.base / m).exists()]
    return ran + [str(p) for p in results.rglob(f"*{TOKEN}*")]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_sweep_file_written_by_another_user_runs_nothing_but_points(two_users, attack):
    """Before: the pickle loaded (the callback), sitecustomize.py imported by the ranks (env_set), the token in a
    results folder name (oc.env). After: exit 2, one line naming file, line, key and flag; no record, no marker."""
    evil = plant(two_users)
    line, named = ATTACKS[attack]
    sweep = attacker_writes(two_users, evil / "sweep.txt", line.format(evil=evil) + "\n")
    results = two_users.base / "results"
    proc = run(
        [
            sys.executable,
            "-m",
            "ptbench.sweep",
            "run",
            str(sweep),
            "--no-comm",
            "--",
            *POINT,
            f"results.root={results}",
        ],
        timeout=300,
        env={**os.environ, "PTBENCH_TEST_TOKEN": TOKEN},
    )
    assert not proof(two_users, results), proof(two_users, results)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {sweep}:1: {named}") and err.endswith(SUFFIX), err
    assert proc.stdout == "" and not results.exists()  # nothing ran, not even the first point's line


SRUN = """#!/bin/bash
printf "%s\\n" "$@" >> "$SRUN_ARGV"
[[ -z ${SRUN_ARGV_ONLY:-} ]] || exit 0
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""


def fake_slurm(folder: Path) -> Path:
    """`srun` for one task here: it writes its argv (one per line) to $SRUN_ARGV, drops its own options and runs
    the task's command (unless SRUN_ARGV_ONLY is set); `sbatch` writes its argv and the trust variable to
    $SBATCH_LOG and prints a job id. Slurm's stand-ins: what is tested is the array script and the sweep command."""
    folder.mkdir(exist_ok=True)
    (folder / "srun").write_text(SRUN)
    (folder / "sbatch").write_text(f'#!/bin/bash\necho "$* {ENV}=${{{ENV}:-}}" >> "$SBATCH_LOG"\necho 4242\n')
    for name in ("srun", "sbatch"):
        (folder / name).chmod(0o755)
    return folder


def array_task(sweep: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    """slurm/array.sbatch as Slurm starts array task 0 of a one-node job (its srun: `fake_slurm`)."""
    slurm = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "77", "SLURM_JOB_ID": "78", "SLURM_NTASKS": "1"}
    job = {**slurm, "SLURM_NNODES": "1", "REPO": str(REPO), "PYTHON": sys.executable, "RESULTS": str(tmp / "res")}
    path = f"{fake_slurm(tmp / 'bin')}:{os.environ['PATH']}"
    full = {**os.environ, **job, "PATH": path, "SRUN_ARGV": str(tmp / "srun-argv"), **env}
    return run(["bash", str(ARRAY), str(sweep), *POINT[1:]], timeout=300, env=full, cwd=tmp)


def test_an_array_task_refuses_another_users_line_before_srun(two_users, tmp_path):
    """Before: the task turned the line into srun's argv and the callback loaded the attacker's pickle. After:
    the task ends 2 with the one line; srun never starts, no record."""
    evil = plant(two_users)
    sweep = attacker_writes(two_users, evil / "sweep.txt", ATTACKS["callback"][0].format(evil=evil) + "\n")
    proc = array_task(sweep, tmp_path)
    assert not (two_users.base / "pickle-ran").exists(), "the pickle loaded in the array task"
    assert not (tmp_path / "srun-argv").exists(), (tmp_path / "srun-argv").read_text()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {sweep}:1: {ATTACKS['callback'][1]}"), err
    assert err.endswith(SUFFIX) and not run_dirs(tmp_path / "res")


def test_shell_metacharacters_in_a_value_reach_srun_as_one_argument(tmp_path):
    """The check leaves values alone: `$(...)`, backquotes, `;` and `|` in a value are one argument of srun, run
    by no shell (the array task's quoting), as before."""
    value = f"++extra.note='$(touch {tmp_path}/dollar);`touch {tmp_path}/tick`|touch {tmp_path}/pipe'"
    sweep = tmp_path / "sweep.txt"
    sweep.write_text(f'experiment=smoke "{value}"\n')
    array_task(sweep, tmp_path, SRUN_ARGV_ONLY="1")
    argv = (tmp_path / "srun-argv").read_text().splitlines()
    assert value in argv, argv
    assert not [p for p in ("dollar", "tick", "pipe") if (tmp_path / p).exists()]


# line -> the start of its refusal (after `FILE:LINE: `)
REFUSED = {
    "++hydra.job.env_set.A=1": "key hydra.job.env_set.A: a hydra.* key",
    "~hydra.callbacks.tally": "key hydra.callbacks.tally: a hydra.* key",
    "hydra.job.chdir=true": "key hydra.job.chdir: a hydra.* key",
    "hydra/launcher=bench_slurm": "key hydra/launcher: a hydra.* key",
    "+experiment@_global_.hydra.x=smoke": "key experiment@_global_.hydra.x: a hydra.* key",
    "trainer.seed=${oc.decode:'3'}": "key trainer.seed: its value calls the resolver oc.decode",
    "results.experiment=x${now:%H}": "key results.experiment: its value calls the resolver now",
    "results.experiment=a${trainer.${oc.env:X}}": "key results.experiment: its value calls the resolver oc.env",
    "experiment=../../../../tmp/x/evil": "key experiment: the config option ../../../../tmp/x/evil is a path",
    "-cd /tmp/x -cn evil": "-cd: a Hydra option, not an override",
    "--experimental-rerun=/tmp/x.pkl": "--experimental-rerun: a Hydra option, not an override",
}


@pytest.mark.parametrize("line", sorted(REFUSED))
def test_each_way_past_a_point_is_refused_in_one_line(tmp_path, line, capsys):
    """`sweep point` (an array task's question) on each line: exit 2 and the one line, without composing it."""
    from ptbench.sweep import main

    sweep = tmp_path / "sweep.txt"
    sweep.write_text(f"# a sweep\n\nexperiment=smoke {line}\n")
    code = main(["point", str(sweep), "0"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (code, out, err)
    err = err.strip()
    assert err.startswith(f"error: {sweep}:3: {REFUSED[line]}") and err.endswith(SUFFIX), err
    assert len(err.splitlines()) == 1


def test_submit_and_grid_refuse_too_and_nothing_is_submitted_or_written(tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("experiment=smoke\n++hydra.job.env_set.A=1\n")
    env = {**os.environ, "PATH": f"{fake_slurm(tmp_path / 'bin')}:{os.environ['PATH']}"}
    env["SBATCH_LOG"] = str(tmp_path / "sbatch.log")
    sub = run(
        [
            sys.executable,
            "-m",
            "ptbench.sweep",
            "submit",
            str(sweep),
            "--no-comm",
            "--",
            f"results.root={tmp_path / 'r'}",
        ],
        timeout=120,
        env=env,
    )
    assert sub.returncode == 2 and sub.stderr.strip().startswith(f"error: {sweep}:2: key hydra.job.env_set.A"), (
        sub.stderr
    )
    assert not (tmp_path / "sbatch.log").exists() and not (tmp_path / "r").exists()
    out = tmp_path / "grid.txt"
    grid = run(
        [sys.executable, "-m", "ptbench.sweep", "grid", "adapter=ddp,zero", "++hydra.job.env_set.A=1", "-o", str(out)],
        timeout=120,
    )
    assert grid.returncode == 2 and not out.exists(), grid.stdout + grid.stderr
    assert grid.stderr.strip().startswith("error: sweep grid ++hydra.job.env_set.A=1: key hydra.job.env_set.A")


def test_the_trust_flag_lets_a_hydra_line_through_everywhere(tmp_path):
    """--trust-sweep-file (or PTBENCH_TRUST_SWEEP_FILE=1, which `submit` passes to its array tasks) runs a line
    with a hydra.* key; a plain `${a.b}` reference needs no flag (it copies a value the config holds)."""
    sweep, results = tmp_path / "sweep.txt", tmp_path / "res"
    sweep.write_text("++hydra.job.env_set.OMP_NUM_THREADS=1 'results.experiment=seed${trainer.seed}'\n")
    cmd = [sys.executable, "-m", "ptbench.sweep"]
    ran = run([*cmd, "run", str(sweep), FLAG, "--no-comm", "--", *POINT, f"results.root={results}"], timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [d.parent.name for d in run_dirs(results)] == ["seed1234"]
    task = run([*cmd, "point", str(sweep), "0"], timeout=120, env={**os.environ, ENV: "1"})
    assert task.returncode == 0, task.stderr
    assert task.stdout.split(maxsplit=2)[2].startswith("++hydra.job.env_set.OMP_NUM_THREADS=1"), task.stdout
    plain = tmp_path / "plain.txt"
    plain.write_text("'results.experiment=seed${trainer.seed}'\n")
    assert run([*cmd, "point", str(plain), "0"], timeout=120).returncode == 0
    env = {**os.environ, "PATH": f"{fake_slurm(tmp_path / 'bin')}:{os.environ['PATH']}"}
    env["SBATCH_LOG"] = str(tmp_path / "sbatch.log")
    sub = run([*cmd, "submit", str(sweep), FLAG, "--no-comm", "--", f"results.root={results}"], timeout=120, env=env)
    assert sub.returncode == 0, sub.stderr
    assert (tmp_path / "sbatch.log").read_text().rstrip().endswith(f"{ENV}=1")  # the array task's environment
    out = tmp_path / "grid.txt"
    grid = run([*cmd, "grid", "adapter=ddp,zero", "++hydra.job.env_set.A=1", FLAG, "-o", str(out)], timeout=120)
    assert grid.returncode == 0 and len(out.read_text().splitlines()) == 4, grid.stderr
