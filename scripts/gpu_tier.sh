#!/usr/bin/env bash
# The whole GPU tier on a machine with an NVIDIA GPU and a CUDA torch, offline: install the kernels from a
# wheelhouse (scripts/gpu_wheelhouse.sh), check every backend, run tests/gpu, and benchmark. Everything it
# measures goes to OUT_DIR: versions.txt, install.log, causal_conv1d.log, backends.txt, gpu_tests.log,
# gpu_results*.json (one per test worker), bench_kernels.log, bench.log, bench/ (bench.json, kernels_cuda.json).
#
# causal-conv1d's CUDA build (minutes) runs in the background while everything that does not need it is checked;
# its backend is checked once it is in. On an H200 (16 cores, 2026-11-28) the install took 35 s, and 6 minutes of
# tests/gpu on 4 workers ended 62 of its 127 tests while the build (10 jobs) had not finished: plan 15-20 minutes.
# mamba-ssm is installed without its CUDA extension (MAMBA_CUDA=skip; only its Triton SSD is used) and imports
# through tests/gpu/stand_ins.
#
# Usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR
#   PYTHON=...            the interpreter with the CUDA torch (default: python3)
#   WORKERS=4             pytest-xdist workers for tests/gpu (0: one process)
#   TEST_TIMEOUT=600      seconds per test (pytest-timeout, when installed)
#   STAGES="verify tests causal-conv1d bench"   the stages to run, in this order (a lease shorter than the whole
#                         tier runs them in separate calls; each call installs again, in 35 s)
#   TESTS="tests/gpu"     what the tests stage passes to pytest (a file, `-k EXPR`, ...)
#   BENCH_TOKENS=         tokens per row of the kernel benchmarks (default: 32768)
#   GPU_TOKENS=           tokens per row of the kernel tests (default: 32768; at least 8192): a short lease's run
#   STAGE_TIMEOUT=        seconds each command of a stage may run (then TERM, KILL 10 s later): a lease's call
#                         that must end in time still writes what the other stages measured
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE="${1:?usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR}"
OUT_DIR="${2:?usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR}"
PYTHON="${PYTHON:-$(command -v python3)}"
VENV="$(dirname "$(dirname "$PYTHON")")"
WORKERS="${WORKERS:-4}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stamp() { echo "gpu_tier $(date +%T): $*"; }

# transformers first (a newer one than the image's may be needed, with the newer dependencies it requires), then
# the kernels' Python packages; causal-conv1d's CUDA build goes to the background.
stamp "installing from $WHEELHOUSE"
"$PYTHON" -m pip install -q --no-index --find-links "$WHEELHOUSE" --upgrade transformers \
    || echo "gpu_tier: no transformers in $WHEELHOUSE; keeping $("$PYTHON" -c 'import transformers as t; print(t.__version__)')"
PARTS=python MAMBA_CUDA=skip WHEELHOUSE="$WHEELHOUSE" bash scripts/install_kernels_gpu.sh "$VENV" \
    > "$OUT_DIR/install.log" 2>&1 || { tail -20 "$OUT_DIR/install.log"; exit 1; }
if ! "$PYTHON" -c 'import selective_scan_cuda' 2>/dev/null; then
    export PYTHONPATH="$PYTHONPATH:$PWD/tests/gpu/stand_ins"
fi
STAGES=" ${STAGES:-verify tests causal-conv1d bench} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
bounded() { if [[ -n "${STAGE_TIMEOUT:-}" ]]; then timeout -k 10 "$STAGE_TIMEOUT" "$@"; else "$@"; fi; }
if stage causal-conv1d; then
    PARTS=causal-conv1d WHEELHOUSE="$WHEELHOUSE" MAX_JOBS="${MAX_JOBS:-10}" bash scripts/install_kernels_gpu.sh \
        "$VENV" > "$OUT_DIR/causal_conv1d.log" 2>&1 &
    BUILD=$!
fi

versions() {
    "$PYTHON" -m pip list 2>/dev/null | grep -Ei '^(torch|triton|transformers|fla-core|flash-linear-attention|mamba-ssm|causal-conv1d|flash-attn) '
    "$PYTHON" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| cuda", torch.version.cuda)'
}
versions > "$OUT_DIR/versions.txt"
cat "$OUT_DIR/versions.txt"

# -v: each test's outcome is in the log when it ends (a run cut short still says which passed and which failed).
PYTEST=("$PYTHON" -m pytest -v --tb=short -p no:cacheprovider -p no:benchmark -p hybrid_pack.testing.pytest_plugin
        -rs --durations=20)
[[ "$WORKERS" != 0 ]] && PYTEST+=(-n "$WORKERS")
"$PYTHON" -c 'import pytest_timeout' 2>/dev/null && PYTEST+=(--timeout "${TEST_TIMEOUT:-600}")

status=0
if stage verify; then
    stamp "backends --verify"
    bounded "$PYTHON" -m hybrid_pack.cli backends --verify --device cuda > "$OUT_DIR/backends.txt" 2>&1
    status=$?
    tail -30 "$OUT_DIR/backends.txt"
fi
if stage tests; then
    stamp "tests: ${TESTS:-tests/gpu}"
    # shellcheck disable=SC2086  # TESTS is split into pytest's arguments on purpose
    HYBRID_PACK_GPU_RESULTS="$OUT_DIR/gpu_results.json" HYBRID_PACK_GPU_TOKENS="${GPU_TOKENS:-}" \
        bounded "${PYTEST[@]}" ${TESTS:-tests/gpu} 2>&1 \
        | tee "$OUT_DIR/gpu_tests.log" | tail -40
    status=$(( status | PIPESTATUS[0] ))
fi
if stage causal-conv1d; then
    stamp "waiting for causal-conv1d's build"
    if wait "$BUILD"; then
        versions > "$OUT_DIR/versions.txt"
        stamp "causal-conv1d built: its backend"
        bounded "$PYTHON" -m hybrid_pack.cli backends --verify --device cuda > "$OUT_DIR/backends.txt" 2>&1
        status=$(( status | $? ))
        HYBRID_PACK_GPU_RESULTS="$OUT_DIR/gpu_results_causal_conv1d.json" bounded "${PYTEST[@]}" \
            tests/gpu/test_kernels.py -k causal_conv1d 2>&1 | tee "$OUT_DIR/gpu_tests_causal_conv1d.log" | tail -15
        status=$(( status | PIPESTATUS[0] ))
    else
        status=1
        tail -20 "$OUT_DIR/causal_conv1d.log"
    fi
fi
# The kernels (boundary cost and adapter overhead: benchmarks/bench_kernels.py), then packed vs padded training.
if stage bench; then
    stamp "benchmarks"
    TOKENS=(${BENCH_TOKENS:+--tokens "$BENCH_TOKENS"})
    bounded "$PYTHON" benchmarks/bench_kernels.py --device cuda "${TOKENS[@]}" > "$OUT_DIR/bench_kernels.log" 2>&1
    status=$(( status | $? ))
    bounded "$PYTHON" -m hybrid_pack.cli bench --device cuda --skip-kernels --out "$OUT_DIR/bench" \
        > "$OUT_DIR/bench.log" 2>&1
    status=$(( status | $? ))
    cp benchmarks/results/kernels_cuda.json "$OUT_DIR/bench/" 2>/dev/null
    tail -40 "$OUT_DIR/bench_kernels.log"
    tail -20 "$OUT_DIR/bench.log"
fi
stamp "done (status $status)"
exit "$status"
