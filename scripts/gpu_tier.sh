#!/usr/bin/env bash
# The whole GPU tier on a machine with an NVIDIA GPU and a CUDA torch, offline: install the kernels from a
# wheelhouse (scripts/gpu_wheelhouse.sh), check every backend, run tests/gpu, and benchmark. Everything it
# measures goes to OUT_DIR: versions.txt, backends.txt, gpu_tests.log, gpu_results.json, bench/ (bench.json,
# kernels_cuda.json).
#
# Usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR   (PYTHON=... for another interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE="${1:?usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR}"
OUT_DIR="${2:?usage: scripts/gpu_tier.sh WHEELHOUSE OUT_DIR}"
PYTHON="${PYTHON:-$(command -v python3)}"
VENV="$(dirname "$(dirname "$PYTHON")")"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# transformers first (a newer one than the image's may be needed, with the newer dependencies it requires), then
# the kernels: the CUDA builds of causal-conv1d and mamba-ssm take minutes, so this step dominates.
"$PYTHON" -m pip install -q --no-index --find-links "$WHEELHOUSE" --upgrade transformers \
    || echo "gpu_tier: no transformers in $WHEELHOUSE; keeping $("$PYTHON" -c 'import transformers as t; print(t.__version__)')"
WHEELHOUSE="$WHEELHOUSE" bash scripts/install_kernels_gpu.sh "$VENV" 2>&1 | tee "$OUT_DIR/install.log" | tail -12

"$PYTHON" -m pip list 2>/dev/null | grep -Ei '^(torch|triton|transformers|fla-core|flash-linear-attention|mamba-ssm|causal-conv1d|flash-attn) ' \
    > "$OUT_DIR/versions.txt"
"$PYTHON" -c 'import torch; print("device:", torch.cuda.get_device_name())' >> "$OUT_DIR/versions.txt"
cat "$OUT_DIR/versions.txt"

"$PYTHON" -m hybrid_pack.cli backends --verify --device cuda > "$OUT_DIR/backends.txt" 2>&1
status=$?
HYBRID_PACK_GPU_RESULTS="$OUT_DIR/gpu_results.json" "$PYTHON" -m pytest -q -p no:cacheprovider \
    -p hybrid_pack.testing.pytest_plugin -rs tests/gpu 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
status=$(( status | PIPESTATUS[0] ))
# The kernels (boundary cost and adapter overhead: benchmarks/bench_kernels.py), then packed vs padded training.
"$PYTHON" benchmarks/bench_kernels.py --device cuda > "$OUT_DIR/bench_kernels.log" 2>&1
status=$(( status | $? ))
"$PYTHON" -m hybrid_pack.cli bench --device cuda --skip-kernels --out "$OUT_DIR/bench" > "$OUT_DIR/bench.log" 2>&1
status=$(( status | $? ))
cp benchmarks/results/kernels_cuda.json "$OUT_DIR/bench/" 2>/dev/null
tail -40 "$OUT_DIR/bench_kernels.log"
tail -20 "$OUT_DIR/bench.log"
exit "$status"
