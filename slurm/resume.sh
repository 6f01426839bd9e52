#!/usr/bin/env bash
# Continue a rollhpc run from its newest good checkpoint in a new Slurm job, from a login node.
#
#   slurm/resume.sh RUN_DIR [key=value ...] [--dry-run] [--wait]
#
#   RUN_DIR      the run's directory (it holds config.yaml, checkpoints/, metrics.jsonl)
#   key=value    only settings that do not change the run (e.g. cluster.partition=..., cluster.time_limit=...);
#                anything else is refused: a checkpoint resumes only under the configuration that wrote it
#   --wait       stay until the job ends; exit status 0 only if the run succeeded
#
# Not needed after a time limit or a node failure: the run continues by itself in a new job (up to
# cluster.max_restarts lost workers). Use it after the job gave up, was cancelled, or failed on a bad node.
# Refuses while the run's last job is still pending or running. RUN_DIR/restarts.jsonl lists every attempt.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/wrapper-common.sh"
help_if_asked "$@"
require_venv
run_dir="$(cd "$1" 2>/dev/null && pwd)" || { echo "slurm/resume.sh: no such run directory: $1" >&2; exit 2; }
shift
if [ ! -f "$run_dir/config.yaml" ]; then
  echo "slurm/resume.sh: $run_dir is not a run directory (no config.yaml)" >&2
  exit 2
fi
exec "$venv/bin/rollhpc" submit "$run_dir/config.yaml" "run.output_dir=$(dirname "$run_dir")" --resume "$@"
