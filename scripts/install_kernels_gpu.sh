#!/usr/bin/env bash
# Install the kernel packages into a virtual environment on an NVIDIA GPU machine, against the torch
# already installed there (nothing here installs or pins torch or triton).
#
#   flash-linear-attention / fla-core  pure Python (Triton kernels): gated delta rule, conv
#   causal-conv1d                      CUDA extension, compiled here for this machine's GPU (a few minutes)
#   mamba-ssm                          only its Triton SSD kernel is used, but the package imports its CUDA
#                                      extension (selective_scan_cuda): compiled here too (the longest step)
#
# flash-attn is left out (its build takes far longer): `pip install flash-attn --no-build-isolation` adds it.
# Usage: scripts/install_kernels_gpu.sh [VENV]   (default: .venv)
# Offline (an air-gapped cluster): WHEELHOUSE=DIR takes every package from DIR, made beforehand on a machine
# with network by scripts/gpu_wheelhouse.sh; nothing is fetched.
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="$VENV/bin/python"
if [[ ! -x "$PYTHON" ]]; then
    echo "install_kernels_gpu.sh: no python at $PYTHON (pass the virtual environment as the first argument)" >&2
    exit 2
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "install_kernels_gpu.sh: torch sees no CUDA device here; use scripts/install_kernels_cpu.sh" >&2
    exit 2
fi

FLA_VERSION=0.6.0
MAMBA_SSM_VERSION=2.3.2.post1
CAUSAL_CONV1D_VERSION=1.7.0
PIP=("$PYTHON" -m pip install)
if [[ -n "${WHEELHOUSE:-}" ]]; then
    PIP+=(--no-index --find-links "$WHEELHOUSE")
fi
ARCH=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}.{minor}')")

"${PIP[@]}" --no-deps "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION" "einops>=0.8" ninja
TORCH_CUDA_ARCH_LIST="$ARCH" CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" \
    "${PIP[@]}" --no-build-isolation --no-deps --force-reinstall --no-cache-dir \
    "causal-conv1d==$CAUSAL_CONV1D_VERSION"  # no cache: the CPU tier's wheel of the same version has no CUDA extension
TORCH_CUDA_ARCH_LIST="$ARCH" MAMBA_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" \
    "${PIP[@]}" --no-build-isolation --no-deps --force-reinstall --no-cache-dir \
    "mamba-ssm==$MAMBA_SSM_VERSION"  # no cache: the CPU tier's wheel of the same version has no CUDA extension

"$PYTHON" - <<'PY'
from importlib.metadata import version
import torch
print(f"device: {torch.cuda.get_device_name()}")
for name in ("torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "causal-conv1d"):
    print(f"{name}=={version(name)}")
import causal_conv1d_cuda  # noqa: F401  (fails here, not in the GPU tier, if the CUDA extension was not built)
import selective_scan_cuda  # noqa: F401  (mamba_ssm does not import without it)
print("causal_conv1d_cuda, selective_scan_cuda: built")
PY
