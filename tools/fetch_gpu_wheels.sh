#!/usr/bin/env bash
# Fetch, on this machine (which has the package index), the cp312 wheels the lent GPU machine lacks, into
# gpu-wheels/ (git-ignored), for tools/gpu_check.sh to install offline there. Carry the folder with the run
# (the device tool's `carry`; about 20 MB of the 64 MiB allowed). The GPU machine has Python 3.12 and its own
# CUDA torch, transformers, safetensors, h5py, matplotlib (../shared/NOTES.md): nothing here replaces them.
#
#   tools/fetch_gpu_wheels.sh [DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$here/gpu-wheels}"
py="${PYTHON:-$here/.venv/bin/python}"
mkdir -p "$dest"
"$py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$dest" \
  megatron-core==0.16.1 mpich==5.0.2 mpi4py==4.1.2 psutil \
  hydra-core==1.3.8 omegaconf==2.3.0 submitit==1.5.4 cloudpickle \
  math-verify==0.9.0 latex2sympy2_extended gymnasium==1.4.0 farama-notifications \
  pytest pytest-timeout pluggy iniconfig
# omegaconf pins antlr4-python3-runtime 4.9.*, published as a source archive only: built here (pure Python)
"$py" -m pip wheel --disable-pip-version-check -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
du -sh "$dest"
ls "$dest"
