# Two commands from a fresh clone: `make demo` (a small CPU sweep and its report) and `make test`.
# Both create .venv and install the project into it on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the tests find real data (Wikitext-2, GPT-2 tokenizer, CIFAR-10 subset); see README.
export BENCH_DATA_ROOT ?= $(abspath ../shared/data)

.PHONY: install demo test smoke gpu-check horovod slurm-up slurm-down clean

# Strict editable install: a tree of links under build/ that Hydra's plugin scan can list (the default
# editable mode hides hydra_plugins.trainbench_launcher from it). Links are per file, so the install is
# redone when a package folder changes (a module added or removed) as well as when pyproject.toml does.
PKG_DIRS := $(shell find bench adapters workloads analysis conf -type d -not -name __pycache__ 2>/dev/null)

$(STAMP): pyproject.toml $(PKG_DIRS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[dev]" --config-settings editable_mode=strict
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(MAKE) smoke

# every installed adapter on the visible GPUs (a one-GPU runner: world size 1), or 2 ranks on a CPU
smoke: $(STAMP)
	$(PY) -m bench.smoke

# With a GPU: the one-GPU smoke, then a short bf16 gpt2_small and resnet50 run per adapter, as a table
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

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
