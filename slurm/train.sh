#!/usr/bin/env bash
# Submit a rollhpc experiment to Slurm, from a login node, without writing any Python.
#
#   slurm/train.sh EXPERIMENT [key=value ...] [--dry-run] [--wait] [--overwrite]
#
#   EXPERIMENT   a name in configs/ (e.g. quickstart) or a path to a .yaml file
#   key=value    overrides, e.g. cluster.partition=gpu cluster.nodes=4 run.name=my-run
#   --dry-run    print the batch script (one heterogeneous job, one component per role group) and stop
#   --wait       stay until the job ends; exit status 0 only if the run succeeded
#
# The run directory (run.output_dir/run.name, default runs/NAME) must be on a filesystem shared with the
# compute nodes. Uses the environment in ROLLHPC_VENV (default: .venv next to this folder; `make venv` builds it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/wrapper-common.sh"
help_if_asked "$@"
require_venv
exec "$venv/bin/rollhpc" submit "$@"
