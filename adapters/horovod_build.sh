#!/usr/bin/env bash
# Build + install Horovod for the torch in a given venv, caching the wheel.
#   usage: bash adapters/horovod_build.sh <path-to-venv-python>      (called by `make horovod`)
# Env: TRAINBENCH_CACHE (default ~/.cache/trainbench), HOROVOD_BUILD_JOBS (default 2; each
# compile with torch headers needs ~1.5 GB RAM), CUDA_HOME (default /usr/local/cuda).
# Plain `pip install horovod==0.28.1` fails with torch 2.14; see NOTES.md §3 "Horovod 0.28.1".
set -euo pipefail
HVD=0.28.1
die() { echo "horovod_build: ERROR: $*" >&2; exit 1; }
say() { echo "horovod_build: $*"; }

[ $# -eq 1 ] || die "usage: $0 <path-to-venv-python>"
[ -x "$1" ] || die "'$1' is not an executable python"
# Absolute path but keep the venv symlink (resolving it would escape the venv).
PY="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
BIN="$(dirname "$PY")"
# horovodrun and the workers it spawns (`python ...`) are looked up on PATH.
export PATH="$BIN:$PATH"
check_build() { "$BIN/horovodrun" --check-build; }

# --- fast path: already installed and its torch extension loads -------------------------------
# (--check-build imports horovod.torch in a subprocess: [X] PyTorch also means the ABI matches.)
if OUT="$("$BIN/horovodrun" --check-build 2>/dev/null)" && grep -q "Horovod v$HVD:" <<<"$OUT" \
        && grep -q '\[X\] PyTorch' <<<"$OUT"; then
    say "horovod $HVD already installed in $BIN"; echo "$OUT"; exit 0
fi

# --- probe torch: version, python tag, CUDA build, GPU compute capability ---------------------
read -r TORCH PYTAG TCUDA GPUCC < <("$PY" -c "
import sys, torch
cc = '%d%d' % torch.cuda.get_device_capability(0) if torch.cuda.is_available() else 'none'
print(torch.__version__.split('+')[0], 'cp%d%d' % sys.version_info[:2],
      (torch.version.cuda or 'none').replace('.', ''), cc)" 2>/dev/null) \
    || die "'$PY' cannot import torch; install the project's venv first"

# --- decide the build variant from what this machine has -------------------------------------
unset HOROVOD_WITHOUT_MPI HOROVOD_GPU_OPERATIONS
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo
# Set MAKEFLAGS explicitly: an inherited one from `make horovod` may carry jobserver flags, and
# an empty one makes Horovod's setup.py use -j8.
export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-2}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ "$TCUDA" != none ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    # A CUDA torch wheel + any nvcc makes Horovod's CMake build CUDA support (even with no GPU),
    # and torch guesses CUDA_HOME from `which nvcc` (here /usr/local: no headers) -> pin it.
    export CUDA_HOME HOROVOD_CUDA_HOME="$CUDA_HOME"
    export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-$([ "$GPUCC" != none ] && echo "$GPUCC" || echo 75)}"
    VARIANT="cu$TCUDA-sm${HOROVOD_BUILD_CUDA_CC_LIST//,/_}"
    if [ "$GPUCC" != none ]; then   # real GPU: NCCL for GPU tensors, if we can find NCCL
        NCCLPY="$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
        if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e "$CUDA_HOME/include/nccl.h" ] || [ -e /usr/include/nccl.h ]; then
            export HOROVOD_GPU_OPERATIONS=NCCL
        elif [ -e "$NCCLPY/include/nccl.h" ]; then
            # torch's pip NCCL has only libnccl.so.2; Horovod's FindNCCL wants libnccl.so.
            NCCLDIR="$(mktemp -d)"; ln -s "$NCCLPY"/lib/libnccl.so.* "$NCCLDIR/libnccl.so"
            export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
                   HOROVOD_NCCL_INCLUDE="$NCCLPY/include" HOROVOD_NCCL_LIB="$NCCLDIR"
        fi
    fi
    VARIANT+="-$([ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && echo nccl || echo gloo)"
else
    VARIANT=cpu-gloo
fi
if command -v mpicc >/dev/null; then VARIANT+=-mpi; else export HOROVOD_WITHOUT_MPI=1; fi

KEY="horovod-$HVD-torch$TORCH-$PYTAG-$VARIANT"
WHEELS="${TRAINBENCH_CACHE:-$HOME/.cache/trainbench}/wheels"
CACHE="$WHEELS/$KEY"
say "python=$PY torch=$TORCH cuda=$TCUDA gpu_cc=$GPUCC -> $KEY"

# Build and runtime deps (--no-build-isolation: setup.py imports these from the venv).
"$PY" -m pip install -q wheel packaging cloudpickle psutil pyyaml cffi numpy setuptools \
    || die "pip could not install Horovod's build dependencies"

# --- build the wheel into the cache if missing ------------------------------------------------
if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    TMP="$(mktemp -d "$WHEELS/.tmp-$KEY.XXXX")"          # same filesystem -> atomic rename
    trap 'rm -rf "$TMP" ${NCCLDIR:+"$NCCLDIR"}' EXIT
    # Horovod's CMake forces -std=c++14 and strips -std from CXXFLAGS; torch 2.14 headers need
    # C++20. A launcher runs "<compiler> <args>": append -std=c++20 so it comes last and wins.
    cat > "$TMP/cxx20" <<'EOF'
#!/bin/sh
exec "$@" -std=c++20
EOF
    chmod +x "$TMP/cxx20"
    export CMAKE_CXX_COMPILER_LAUNCHER="$TMP/cxx20"
    # If ccache exists, Horovod's CMake overrides the launcher with it: hook in via ccache instead.
    export CCACHE_PREFIX="$TMP/cxx20" CCACHE_PREFIX_CPP="$TMP/cxx20"
    say "building $KEY (3-6 min on 2 cores; log: $TMP/build.log)"
    SECONDS=0
    "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir --no-binary horovod \
        -w "$TMP/whl" "horovod==$HVD" > "$TMP/build.log" 2>&1 || {
        tail -n 30 "$TMP/build.log" >&2; cp "$TMP/build.log" "$WHEELS/$KEY.failed.log"
        die "Horovod build failed (full log: $WHEELS/$KEY.failed.log)"; }
    say "built in ${SECONDS}s"; rm -f "$WHEELS/$KEY.failed.log"
    # Rename publishes the cache entry; if another build won the race, keep theirs.
    mv -T "$TMP/whl" "$CACHE" 2>/dev/null || say "cache entry appeared meanwhile; using it"
else
    say "using cached wheel $CACHE"
fi

# --- install (force: a broken/other-torch build of the same version must be replaced) ---------
"$PY" -m pip install -q --no-deps --force-reinstall "$CACHE"/horovod-*.whl \
    || die "pip could not install $CACHE/horovod-*.whl"
"$PY" -c "import horovod.torch" || die "horovod installed but 'import horovod.torch' fails"
check_build
