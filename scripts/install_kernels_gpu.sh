#!/usr/bin/env bash
# Install the kernel packages into a virtual environment on an NVIDIA GPU machine, against the torch
# already installed there (nothing here installs or pins torch or triton).
#
#   flash-linear-attention / fla-core  pure Python (Triton kernels): gated delta rule, conv
#   causal-conv1d                      CUDA extension, compiled here for this machine's GPU only (about 4 min
#                                      on 16 cores)
#   mamba-ssm                          only its Triton SSD kernel is used, but the package imports its CUDA
#                                      extension (selective_scan_cuda) at import: compiled here too (the
#                                      longest step) unless MAMBA_CUDA=skip, which installs the Python
#                                      package alone (then `import mamba_ssm` needs that module from elsewhere;
#                                      scripts/gpu_tier.sh puts an empty one on the path)
#
# flash-attn is left out (its build takes far longer): `pip install flash-attn --no-build-isolation` adds it.
# Usage: scripts/install_kernels_gpu.sh [VENV]   (default: .venv)
#   PARTS="python causal-conv1d"   what to install (default: all of python, causal-conv1d); `python` is fla,
#                                  einops, ninja and mamba-ssm; the CUDA build of causal-conv1d can then run
#                                  on its own, in the background
#   WHEELHOUSE=DIR                 offline (an air-gapped cluster): every package from DIR, made beforehand on
#                                  a machine with network by scripts/gpu_wheelhouse.sh; nothing is fetched
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="$VENV/bin/python"
PARTS="${PARTS:-python causal-conv1d}"
MAMBA_CUDA="${MAMBA_CUDA:-build}"
if [[ ! -x "$PYTHON" ]]; then
    echo "install_kernels_gpu.sh: no python at $PYTHON (pass the virtual environment as the first argument)" >&2
    exit 2
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "install_kernels_gpu.sh: torch sees no CUDA device here; use scripts/install_kernels_cpu.sh" >&2
    exit 2
fi
if [[ "$MAMBA_CUDA" != build && "$MAMBA_CUDA" != skip ]]; then
    echo "install_kernels_gpu.sh: MAMBA_CUDA: expected build or skip; got '$MAMBA_CUDA'" >&2
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
# No cache on the builds: the CPU tier's wheel of the same version has no CUDA extension.
BUILD=(--no-build-isolation --no-deps --force-reinstall --no-cache-dir)

if [[ " $PARTS " == *" python "* ]]; then
    "${PIP[@]}" --no-deps "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION" "einops>=0.8" ninja
    # FORCE_BUILD in both: without it mamba-ssm's setup.py first downloads a prebuilt wheel, which fails offline.
    if [[ "$MAMBA_CUDA" == skip ]]; then
        MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${PIP[@]}" "${BUILD[@]}" "mamba-ssm==$MAMBA_SSM_VERSION"
    else
        TORCH_CUDA_ARCH_LIST="$ARCH" MAMBA_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" \
            "${PIP[@]}" "${BUILD[@]}" "mamba-ssm==$MAMBA_SSM_VERSION"
    fi
fi
if [[ " $PARTS " == *" causal-conv1d "* ]]; then
    TORCH_CUDA_ARCH_LIST="$ARCH" CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" \
        "${PIP[@]}" "${BUILD[@]}" "causal-conv1d==$CAUSAL_CONV1D_VERSION"
fi

"$PYTHON" - "$PARTS" "$MAMBA_CUDA" <<'PY'
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

parts, mamba_cuda = sys.argv[1].split(), sys.argv[2]
print(f"device: {torch.cuda.get_device_name()}")
for name in ("torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "causal-conv1d"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
# Fails here, not in the GPU tier, when a CUDA extension that was to be built was not.
if "causal-conv1d" in parts:
    import causal_conv1d_cuda  # noqa: F401
    print("causal_conv1d_cuda: built")
if "python" in parts and mamba_cuda == "build":
    import selective_scan_cuda  # noqa: F401
    print("selective_scan_cuda: built")
elif "python" in parts and importlib.util.find_spec("selective_scan_cuda") is None:
    print("selective_scan_cuda: not built (MAMBA_CUDA=skip); mamba_ssm imports only with a stand-in on the path")
PY
