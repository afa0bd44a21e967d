# Two commands from a fresh clone: `make demo` (a small CPU sweep and its report) and `make test`.
# Both create .venv and install the project into it on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the tests find real data (Wikitext-2, GPT-2 tokenizer, CIFAR-10 subset); see README.
export BENCH_DATA_ROOT ?= $(abspath ../shared/data)

.PHONY: install demo test smoke horovod slurm-up slurm-down clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(MAKE) smoke

smoke: $(STAMP)
	$(PY) -m bench.smoke

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
