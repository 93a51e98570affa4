#!/usr/bin/env bash
# Install the real kernel packages into a virtual environment for the CPU interpreter tier
# (tests/kernels, run with TRITON_INTERPRET=1). No GPU and no CUDA toolkit needed: the Triton
# kernels of flash-linear-attention and mamba-ssm run in Triton's interpreter, and the CUDA
# extensions of mamba-ssm / causal-conv1d are skipped at build time (tests/kernels/triton_cpu.py stands in
# for them).
#
# Usage: scripts/install_kernels_cpu.sh [VENV]   (default: .venv)
# Never pulls torch: every package is installed with --no-deps against the torch already there.
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="$VENV/bin/python"
if [[ ! -x "$PYTHON" ]]; then
    echo "install_kernels_cpu.sh: no python at $PYTHON (pass the virtual environment as the first argument)" >&2
    exit 2
fi

TRITON_VERSION=3.7.1            # the triton torch 2.13 pins on Linux
FLA_VERSION=0.6.0               # flash-linear-attention and fla-core
MAMBA_SSM_VERSION=2.3.2.post1
CAUSAL_CONV1D_VERSION=1.7.0

"$PYTHON" -m pip install --no-deps \
    "triton==$TRITON_VERSION" \
    "fla-core==$FLA_VERSION" \
    "flash-linear-attention==$FLA_VERSION" \
    "einops>=0.8"

MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    "$PYTHON" -m pip install --no-build-isolation --no-deps \
    "mamba-ssm==$MAMBA_SSM_VERSION" \
    "causal-conv1d==$CAUSAL_CONV1D_VERSION"

"$PYTHON" - <<'PY'
from importlib.metadata import version
for name in ("torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "causal-conv1d"):
    print(f"{name}=={version(name)}")
PY
