#!/usr/bin/env bash
# Make the wheelhouse that scripts/gpu_tier.sh installs from on a GPU machine with no network.
# Run it where PyPI is reachable. It holds the kernel packages (flash-linear-attention and fla-core wheels;
# mamba-ssm and causal-conv1d as source, built on the GPU machine against its torch), what they import or build
# with besides torch (einops, ninja), and the transformers release of the `hf` extra with its dependencies, as
# binary wheels for each Python in PY_VERSIONS. Nothing in it pins or carries torch or triton: the GPU machine's
# own serve.
#
# Usage: scripts/gpu_wheelhouse.sh [DIR]   (default: .whl, which git ignores)
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-.whl}"
PY_VERSIONS="${PY_VERSIONS:-3.10 3.11 3.12 3.13}"   # the GPU machine's python is one of these
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Versions: the ones scripts/install_kernels_gpu.sh installs, and transformers as pyproject.toml's hf extra allows.
KERNELS=$(sed -n 's/^\(FLA_VERSION\|MAMBA_SSM_VERSION\|CAUSAL_CONV1D_VERSION\)=\([^ ]*\).*/\1=\2/p' \
    scripts/install_kernels_gpu.sh)
eval "$KERNELS"
TRANSFORMERS=$(python3 -c 'import tomllib; extra = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(next(r for r in extra["optional-dependencies"]["hf"] if r.startswith("transformers")))')

for PY_VERSION in $PY_VERSIONS; do
    BINARY=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${PLATFORMS[@]}" -d "$DIR")
    # transformers, einops and ninja with their dependencies (none of them needs torch); fla's wheels alone.
    python3 -m pip download -q "${BINARY[@]}" "$TRANSFORMERS" "einops>=0.8" ninja
    python3 -m pip download -q --no-deps "${BINARY[@]}" "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION"
done
# Sources: pip reads their metadata by running setup.py, which imports torch: use a python that has it (the
# project's venv), with the CUDA builds switched off (they happen on the GPU machine).
VENV_PYTHON="${VENV_PYTHON:-.venv/bin/python}"
MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
    "$VENV_PYTHON" -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d "$DIR" \
    "mamba-ssm==$MAMBA_SSM_VERSION" "causal-conv1d==$CAUSAL_CONV1D_VERSION"
ls -la "$DIR"
