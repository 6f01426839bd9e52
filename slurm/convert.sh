#!/usr/bin/env bash
# Convert a checkpoint between Hugging Face and Megatron formats as a Slurm batch job, without writing Python.
#
#   slurm/convert.sh hf-to-mcore SRC DST [--tp N] [--pp N] [--ep N] [--etp N] [--verify] [--overwrite]
#   slurm/convert.sh mcore-to-hf SRC DST [--max-shard-size 5GB] [--verify] [--overwrite]
#   add --dry-run to print the batch script and stop, --wait to stay until the job ends (exit 0 only on success)
#
#   SRC, DST   directories on a filesystem the compute node shares; the log is written beside DST
#              (DST.convert-JOBID.log) and ends with the peak memory and the largest shard
#   settings   environment variables: CONVERT_PARTITION, CONVERT_ACCOUNT, CONVERT_TIME (default 04:00:00),
#              CONVERT_CPUS (default 16), CONVERT_MEM (default 0 = all of the node's memory)
#
# One node, CPU only: hf-to-mcore runs tp x pp x ep worker processes there, mcore-to-hf one.
# Uses the environment in ROLLHPC_VENV (default: .venv next to this folder; `make venv` builds it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/wrapper-common.sh"
help_if_asked "$@"
require_venv
dry_run=0; wait_flag=(); args=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry_run=1 ;;
    --wait) wait_flag=(--wait) ;;
    *) args+=("$a") ;;
  esac
done
if [ ${#args[@]} -lt 3 ] || { [ "${args[0]}" != hf-to-mcore ] && [ "${args[0]}" != mcore-to-hf ]; }; then
  echo "slurm/convert.sh: usage: slurm/convert.sh hf-to-mcore|mcore-to-hf SRC DST [options] (--help for more)" >&2
  exit 2
fi
# Absolute paths: the job may start in another directory.
src="$(realpath -m "${args[1]}")"; dst="$(realpath -m "${args[2]}")"
args[1]="$src"; args[2]="$dst"
# Check the arguments and the inputs (config, tensor names and shapes, layout) here, on the login node,
# rather than after waiting in the queue.
"$venv/bin/rollhpc" convert "${args[@]}" --check
command_line="$(printf '%q ' "$venv/bin/rollhpc" convert "${args[@]}" --no-progress)"
options="#SBATCH --partition=${CONVERT_PARTITION:-}"
[ -n "${CONVERT_PARTITION:-}" ] || options=""
[ -z "${CONVERT_ACCOUNT:-}" ] || options="$options${options:+
}#SBATCH --account=$CONVERT_ACCOUNT"
script="#!/usr/bin/env bash
#SBATCH --job-name=rollhpc-convert
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=${CONVERT_CPUS:-16}
#SBATCH --mem=${CONVERT_MEM:-0}
#SBATCH --time=${CONVERT_TIME:-04:00:00}
#SBATCH --output=\"${dst}.convert-%j.log\"
${options}${options:+
}set -euo pipefail
export OMP_NUM_THREADS=\${SLURM_CPUS_PER_TASK:-1}
echo \"rollhpc convert on \$(hostname), job \${SLURM_JOB_ID:-?}\"
exec ${command_line}
"
if [ "$dry_run" = 1 ]; then
  printf '%s' "$script"
  exit 0
fi
if ! command -v sbatch >/dev/null; then
  echo "slurm/convert.sh: sbatch not found: run it on a Slurm login node (or add --dry-run to see the script)" >&2
  exit 2
fi
mkdir -p "$(dirname "$dst")"
job="$(printf '%s' "$script" | sbatch --parsable "${wait_flag[@]}")" || status=$?
echo "slurm/convert.sh: job ${job%%;*}; log: ${dst}.convert-${job%%;*}.log" >&2
exit "${status:-0}"
