# Sourced by the slurm/*.sh wrappers (not run by itself): where the repository and its environment are,
# --help from the wrapper's header comment, and one clear error when the environment is missing.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(realpath -m "${ROLLHPC_VENV:-$repo/.venv}")"
wrapper="slurm/$(basename "$0")"

# Print the header comment of the running wrapper (everything after the #! line up to the first code line).
wrapper_help() {
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# Exit 0 after printing the help when there are no arguments or the first is -h/--help.
help_if_asked() {
  if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    wrapper_help
    exit 0
  fi
}

require_venv() {
  if [ ! -x "$venv/bin/rollhpc" ]; then
    echo "$wrapper: no rollhpc environment at $venv: run 'make venv' in $repo or set ROLLHPC_VENV" >&2
    exit 2
  fi
}
