#!/usr/bin/env bash
# One cell of the torch x Python matrix (make test-torch TORCH=2.11 PYTHON=3.12): every adapter's smoke, the
# equal-loss tests and the GPU-twin tests against one torch. The venv lives outside the checkout and is
# reused; torch and torchvision come from ptbench.core.torch_support (the tested list), every other package
# at constraints.txt's version, so only torch and Python change. PIP_CONSTRAINT replaces any pip-wide
# constraint file (one that caps torch below the cell's). Prints one table row: torch, Python, result, minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
minor=${1:?usage: torch_matrix.sh TORCH PYTHON VENV}
python=${2:?usage: torch_matrix.sh TORCH PYTHON VENV}
venv=${3:?usage: torch_matrix.sh TORCH PYTHON VENV}
workers=${TEST_WORKERS:-3}

pins=$(python3 - "$minor" <<'EOF'
import runpy, sys
tested = runpy.run_path("bench/core/torch_support.py")["TESTED_TORCH"]
if sys.argv[1] not in tested:
    sys.exit(f"TORCH={sys.argv[1]} is not in the tested list ({', '.join(tested)}) of bench/core/torch_support.py: add it there with its torchvision")
print(*tested[sys.argv[1]][:2])
EOF
)
read -r torch torchvision <<<"$pins"
interp=$(command -v "python$python" || true)
[ -n "$interp" ] || { echo "PYTHON=$python: no python$python on PATH (install it, e.g. pyenv install $python)"; exit 2; }

# INSTALL=0 reuses a venv as it is (the project's own .venv, which make install keeps)
if [ "${INSTALL:-1}" != 0 ]; then
    if [ ! -x "$venv/bin/python" ]; then "$interp" -m venv "$venv"; fi
    "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
    { grep -viE '^(torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==' constraints.txt
      echo "torch==$torch"; echo "torchvision==$torchvision"; } >"$venv/matrix-constraints.txt"
    PIP_CONSTRAINT="$venv/matrix-constraints.txt" "$venv/bin/python" -m pip install -q -e ".[dev]" \
        --config-settings editable_mode=strict
fi
got=$("$venv/bin/python" -c 'import platform, torch; print(torch.__version__, platform.python_version())')
echo "test-torch: $venv has torch and Python $got"

# the smoke test of each adapter (Makefile, above `test:`), the equal-loss tests, the GPU twins
tests=(
    tests/test_spine.py::test_ddp_two_ranks_equal_one_rank_same_global_batch_gpt2
    tests/test_spine.py::test_ddp_two_ranks_equal_one_rank_resnet50_cifar
    tests/test_launch.py::test_run_under_torchrun_equals_local_run
    tests/test_sharded.py::test_gpt2_zero_stages_and_fsdp_train_like_ddp
    tests/test_sharded.py::test_resnet_zero_stages_and_fsdp_train_like_ddp
    tests/test_sharded.py::test_bf16_mixed_precision_state_and_losses
    tests/test_tensor_parallel.py::test_megatron_tp2_matches_tp1_with_half_the_sharded_bytes
    tests/test_tensor_parallel.py::test_torch_tensor_parallel_matches_single_process
    tests/test_pipeline.py::test_gpipe_two_cpu_partitions_equal_unpipelined
    tests/test_pipeline.py::test_pipeline_two_ranks_equal_unpipelined
    tests/test_horovod.py::test_gpt2_horovodrun_and_srun_style_equal_ddp
    tests/test_gpu_path_cpu_twins.py
    tests/test_gpu_first_run.py
    tests/test_gpu_runtime_twins.py
    tests/test_attention_and_cuda_memory.py
    "tests/test_gpu_check_cpu.py::test_sync_counter_counts_host_reads_per_timed_step_with_their_lines"
    "tests/test_gpu_check_cpu.py::test_every_row_gets_the_same_global_batch"
    "tests/test_gpu_check_cpu.py::test_micro_checks_on_cpu_measure_the_loss_path_and_see_the_start_environment"
    tests/test_environments.py
)
start=$(date +%s)
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n "$workers" "${tests[@]}" | tee "$venv/matrix-pytest.log"
rc=${PIPESTATUS[0]}
set -e
minutes=$(python3 -c "print(f'{($(date +%s) - $start) / 60:.1f}')")
result=$(tail -n 1 "$venv/matrix-pytest.log" | sed -E 's/^=+ //; s/ in [0-9.]+s.*$//')
echo "| $got | $result | $minutes |" | sed -E 's/^\| ([^ ]+) ([^ ]+) /| \1 | \2 /'
exit "$rc"
