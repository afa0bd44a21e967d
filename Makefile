# Two commands from a fresh clone: `make demo` (a small CPU sweep and its report) and `make test`.
# Both create .venv and install the project into it on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the tests find real data (Wikitext-2, GPT-2 tokenizer, CIFAR-10 subset); see README.
export BENCH_DATA_ROOT ?= $(abspath ../shared/data)

.PHONY: install constraints wheelhouse demo paper-demo test test-torch lint smoke gpu-check scale horovod slurm-up slurm-down clean

# Strict editable install: a tree of links under build/, where a module added to the checkout is seen only after
# a reinstall, as in the wheel (pip's default editable mode, the README's notebook route, works too: pyproject.toml).
# Links are per file, so the install is redone when a package folder changes (a module added or removed) as well
# as when pyproject.toml does.
PKG_DIRS := $(shell find bench adapters workloads analysis conf slurm -type d -not -name __pycache__ 2>/dev/null)

# .[dev] holds every framework a plain pip install brings (.[all]) and the test tools; constraints.txt pins
# them to the tested set (reproducible), while pyproject.toml keeps ranges for users installing onto their own torch.
$(STAMP): pyproject.toml constraints.txt $(PKG_DIRS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]" --config-settings editable_mode=strict
	touch $@

install: $(STAMP)

# constraints.txt again from the installed venv (after a deliberate upgrade, and make horovod): name==version of
# everything but the project itself and pip's own tools; a pin of a package not installed here (Horovod before
# make horovod) is kept and named, never dropped in silence (.ci/constraints.py)
constraints: $(STAMP)
	$(PY) .ci/constraints.py constraints.txt

# Offline install for air-gapped compute nodes (README, "Offline install"): on a machine with index access, fill
# WHEELHOUSE with wheels for the nodes' Python and platform (one folder each: a folder holding another's wheels
# is refused, .ci/wheelhouse_target.py stamp), copy it over, then on the node:
#   bash wheelhouse/install.sh [VENV]       (VENV: a venv seeing the node's packages, for a PEP 668 Python)
# which is `pip install --no-index --find-links wheelhouse 'ptbench[EXTRAS]'` (.ci/wheelhouse_install.sh).
# WITH_TORCH=0 (the default) leaves torch, torchvision and their CUDA libraries out: the cluster brings its own torch
# (module, NGC container), which the install keeps; WITH_TORCH=1 adds the tested torch (CUDA wheels: several GB).
# TARGET_FREEZE=<file> (the target's `pip freeze`, or its package names one a line; .ci/gpu-target-packages.txt is
# the GPU machine's) leaves out everything the target already has, its torch included, and resolves the rest
# against the target's versions where the file gives them (.ci/wheelhouse_target.py).
# Packages published only as source are built here into pure-Python wheels. Horovod is not in it: it must be
# built on the node against its torch (make horovod).
WHEELHOUSE ?= wheelhouse
PYTHON_VERSION ?= $(shell $(PY) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null || echo 3.11)
PLATFORM ?= manylinux_2_28_x86_64
EXTRAS ?= all
WITH_TORCH ?= 0
TARGET_FREEZE ?=
# pure-Python packages of the set published only as source: built here (pip wheel) so the target needs no build
SDIST_ONLY ?= antlr4-python3-runtime deepspeed torchgpipe python-hostlist
# pip does not widen a custom --platform to the older manylinux tags a glibc also runs: list them
WH_PLATFORMS = $(shell $(PY) -c 'import re, sys; p = sys.argv[1]; m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", p); \
	print(" ".join(f"--platform {t}" for t in [p] + ([f"manylinux_2_{i}_{m[2]}" for i in range(int(m[1]) - 1, 16, -1)] \
	+ [f"manylinux2014_{m[2]}"] if m else [])))' $(PLATFORM))
WH_TARGET = --python-version $(PYTHON_VERSION) $(WH_PLATFORMS) --only-binary=:all:
# left out unless WITH_TORCH=1: what a cluster's own torch already brings
# (nvidia-ml-py, NVML, is ptbench's own dependency, not torch's)
WH_TORCH_RE := ^(torch|torchvision|triton|nvidia-(?!ml-py$$).*|cuda-.*)$$
WH_PINS = $(WHEELHOUSE)/.constraints.txt
wheelhouse: $(STAMP)
	@$(PY) .ci/wheelhouse_target.py stamp $(WHEELHOUSE) 'Python $(PYTHON_VERSION) on $(PLATFORM)'
	rm -rf $(WHEELHOUSE)/.resolve $(WHEELHOUSE)/ptbench-*.whl
	@$(PY) .ci/wheelhouse_target.py constraints constraints.txt '$(TARGET_FREEZE)' > $(WH_PINS)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEELHOUSE) . 2>/dev/null
	$(PY) -m pip wheel -q --no-deps -c $(WH_PINS) -w $(WHEELHOUSE) $(SDIST_ONLY)
	$(PY) -m pip install -q --dry-run --ignore-installed --target $(WHEELHOUSE)/.resolve $(WH_TARGET) \
		-c $(WH_PINS) --find-links $(WHEELHOUSE) --report $(WHEELHOUSE)/.report.json \
		"$$(ls $(WHEELHOUSE)/ptbench-*.whl)[$(EXTRAS)]"
	$(PY) .ci/wheelhouse_target.py pick $(WHEELHOUSE)/.report.json '$(TARGET_FREEZE)' $(WITH_TORCH) \
		'$(WH_TORCH_RE)' $(WHEELHOUSE) $(WH_TARGET)
	$(PY) -m pip download -q --no-deps -d $(WHEELHOUSE) $(WH_TARGET) --find-links $(WHEELHOUSE) -r $(WHEELHOUSE)/requirements.txt
	rm -rf $(WHEELHOUSE)/.resolve $(WHEELHOUSE)/.report.json $(WH_PINS)
	sed 's/@EXTRAS@/$(EXTRAS)/' .ci/wheelhouse_install.sh > $(WHEELHOUSE)/install.sh
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels, $$(du -sh --apparent-size $(WHEELHOUSE) | cut -f1), for Python $(PYTHON_VERSION) on $(PLATFORM) (WITH_TORCH=$(WITH_TORCH)$(if $(TARGET_FREEZE),; less what $(TARGET_FREEZE) lists)); on the node:"
	@echo "  bash $(WHEELHOUSE)/install.sh            (pip install --no-index --find-links $(WHEELHOUSE) 'ptbench[$(EXTRAS)]')"
	@echo "  bash $(WHEELHOUSE)/install.sh VENV       (a PEP 668 Python: a venv over it that sees its packages, its torch)"

demo: $(STAMP)
	$(PY) -m ptbench.demo

# The paper's protocol at CPU scale on the local Slurm cluster (started here if down; needs root):
# `ptbench.paper plan --submit` (phase 1 epoch time, phase 2 statistical efficiency after it, phase 3
# memory) for ddp, zero, pipeline and pipedream (2 ranks; phase 2 adds 2BW, 1F1B and DDP at its global batch)
# at 1 and 2 ranks on a tiny GPT-2, then the report with its "Paper claims" section. --one-at-a-time: every task
# runs alone, so no timing run shares the node's cores with another. Records and report under
# results/paper-demo-<time>/.
PAPER_DEMO := results/paper-demo-$(shell date +%Y%m%d-%H%M%S)
PAPER_DEMO_SIZE := data=synthetic data.train_samples=128 data.val_samples=32 workload.vocab_size=256 \
	trainer.batch_size=8 trainer.untimed_steps=1 trainer.progress=false
paper-demo: $(STAMP)
	bash slurm/local_cluster.sh status >/dev/null 2>&1 || bash slurm/local_cluster.sh start
	RESULTS=$(abspath $(PAPER_DEMO)) $(PY) -m ptbench.paper plan --workloads gpt2_tiny \
		--adapters ddp,zero,pipeline,pipedream --gpus 1,2 --stateff-epochs 3 --out $(PAPER_DEMO)/plan --submit \
		--one-at-a-time -- $(PAPER_DEMO_SIZE)
	$(PY) -m ptbench.paper wait $(PAPER_DEMO)/plan --timeout 2400
	$(PY) -m ptbench.analysis report $(PAPER_DEMO) --out $(PAPER_DEMO)/report
	@echo "paper demo: records in $(PAPER_DEMO)/, report in $(PAPER_DEMO)/report/report.md"

# The suite runs every path `make smoke` runs on a CPU (2 ranks), so `make test` no longer runs the smoke
# after it. Smoke case (bench/smoke.py, world size 2) -> the test that runs the same adapter path:
#   ddp              tests/test_launch.py (conftest smoke_run: experiment=smoke, 2 local ranks), test_spine.py
#   zero             tests/test_sharded.py::test_gpt2_zero_stages_and_fsdp_train_like_ddp (stages 0-3, 2 ranks)
#   fsdp             tests/test_sharded.py::test_gpt2_zero_stages_and_fsdp_train_like_ddp (2 ranks)
#   megatron         tests/test_tensor_parallel.py::test_megatron_tp2_matches_tp1_with_half_the_sharded_bytes (TP=2)
#   tensor_parallel  tests/test_tensor_parallel.py::test_torch_tensor_parallel_matches_single_process (TP=2)
#   gpipe            tests/test_pipeline.py::test_gpipe_two_cpu_partitions_equal_unpipelined (1 process, 2 partitions)
#   pipeline         tests/test_pipeline.py::test_pipeline_two_ranks_equal_unpipelined (2 ranks)
#   horovod          tests/test_horovod.py::test_gpt2_horovodrun_and_srun_style_equal_ddp (fails under CI=true if absent)
#   the smoke driver tests/test_gpu_path_cpu_twins.py (layout per adapter, skip reasons, `python -m ptbench.smoke` itself)
# Three pytest-xdist workers, whole files each, the Slurm files together (tests/conftest.py): the ranks of
# one test rarely keep 2 cores busy (measured on 2 cores, the same code: 2 workers 835 s; 3 workers 701 s,
# the cores 99 % busy). TEST_WORKERS=1 runs one file after another.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# One cell of the torch x Python matrix, run before a release (README, "Tested environments"; CI keeps one
# torch): a venv outside the checkout (made once, then reused) with that torch and its torchvision from the
# index, every other package at constraints.txt's version; then each adapter's smoke, the equal-loss tests and
# the GPU twins (.ci/torch_matrix.sh). TORCH is a minor listed in bench/core/torch_support.py.
TORCH ?= 2.14
PYTHON ?= 3.11
TORCH_VENV ?= $(abspath ..)/venvs/torch$(TORCH)-py$(PYTHON)
test-torch:
	TEST_WORKERS=$(TEST_WORKERS) bash .ci/torch_matrix.sh $(TORCH) $(PYTHON) $(TORCH_VENV)

# ruff's linter and formatter, configured in pyproject.toml (tests/test_lint.py runs the same in `make test`)
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# every installed adapter on the visible GPUs (a one-GPU runner: world size 1), or 2 ranks on a CPU
smoke: $(STAMP)
	$(PY) -m ptbench.smoke

# Every adapter x workload at 8-1024 ranks, first and last rank, as a dry run (torch's fake process group,
# FakeTensorMode; bench/scale/): collective ledger and memory tracker beside the comm formula and the memory model;
# no times. Each point forked from one warm process, SCALE_JOBS at once, stopped after 2 minutes of its CPU
SCALE_JOBS ?= 2
scale: $(STAMP)
	$(PY) -m ptbench.scale --matrix --jobs $(SCALE_JOBS) --out results/scale/matrix.json

# With a GPU, inside BUDGET seconds for the whole command (default 480): ddp's smoke, then a short bf16 gpt2_small
# and resnet50 run per adapter, then the micro-checks, each row printed and kept in OUT/gpu_check.jsonl as it
# finishes (OUT: default results/gpu-check-<time>/; the same OUT again runs only the rows not yet done)
BUDGET ?= 480
gpu-check: $(STAMP)
	$(PY) -m ptbench.gpu_check --budget $(BUDGET) $(if $(OUT),--out $(OUT))

# Optional: build Horovod 0.28.1 for the installed torch (cached wheel; see adapters/horovod_build.sh)
horovod: $(STAMP)
	bash adapters/horovod_build.sh $(PY)

# A real one-node Slurm cluster on this machine (Debian, as root) for trying slurm/ scripts
slurm-up:
	bash slurm/local_cluster.sh start --accounting
slurm-down:
	bash slurm/local_cluster.sh stop

clean:
	rm -rf $(VENV) .pytest_cache
