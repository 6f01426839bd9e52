#!/usr/bin/env bash
# The prepared check of the GPU path, for a lent GPU machine: one call, under 8 minutes, everything it
# measures in one folder. What it runs, in order (each step's status and seconds in OUT/steps.jsonl):
#   1. env      the machine: GPU, driver, Python, torch and its CUDA (OUT/env.txt)
#   2. install  a venv over the machine's own Python and torch (--system-site-packages: its CUDA torch stays)
#               and the wheels carried in WHEELS (megatron-core, mpich, mpi4py, hydra-core, pytest, ...; fetched
#               by tools/fetch_gpu_wheels.sh), --no-deps, offline; rollhpc itself from this tree (PYTHONPATH)
#   3. gpu      the -m gpu tests (tests/world/test_gpu.py): bf16 Megatron against the CPU loss, offload and reload,
#               CUDA-IPC weight sync streamed through two slots (its peak extra GPU memory against the model's
#               size: cuda_ipc's peak_extra_mib / model_mib), a checkpoint moved between GPU and CPU; their numbers in
#               OUT/gpu_tests.jsonl (ROLLHPC_GPU_RESULTS)
#   4. bandwidth the device's own copy bandwidth and pinned host <-> device copies, the yardsticks of the
#               offload and IPC numbers (tools/gpu_bandwidth.py -> OUT/bandwidth.json)
#   5. rlvr     1-GPU RLVR runs of the quickstart on CUDA (20 steps): trainer and the torch engine colocated on
#               GPU 0, with offload (taking turns) and without, the weight sync by CUDA IPC, verified after
#               every sync, bf16 on megatron-core's optimizer (fp32 main weights) (OUT/rlvr/offload-*)
#   6. cluster_check  the cluster check (configs/cluster_check.yaml) of the quickstart's layout on this one GPU:
#               each rank's host, GPU and cores against the plan, GPU memory after the start-up turns beside the
#               plan's, one RL step and its CUDA-IPC weight sync (OUT/cluster_check/cluster_check/cluster_check.json)
# Every RLVR run's start-up turns (RUN_DIR/startup.json: trainer, then the colocated torch engine) are in summary.json.
# A step that fails is recorded and the next one still runs; the exit status is 1 if any failed.
# vLLM's CUDA build is too large to carry, so generation on the GPU uses the torch engine (INSTALL.md).
#
#   tools/gpu_check.sh [--dry-run] [--out DIR] [--venv DIR] [--wheels DIR] [--python PY] [--steps env,install,...]
#
# Each step's commands run under a time limit of their own (env 60 s, install 180, gpu 240, bandwidth 90,
# rlvr 300, cluster_check 150; GPU_CHECK_LIMITS="gpu=150,rlvr=200" changes them), so that one that hangs leaves the lease's
# minutes to the rest. --venv puts the venv outside OUT (the device tool brings back only a few files).
#
# --dry-run prints each step's commands and runs none (CI runs it on machines without a GPU).
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$here/gpu-check-out}"
wheels="$here/gpu-wheels"
python="python3"
dry=0
venv=""
steps="env,install,gpu,bandwidth,rlvr,cluster_check"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out="$2"; shift ;;
    --venv) venv="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    --python) python="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
venv="${venv:-$out/venv}"
py="$venv/bin/python"
limits="env=60,install=180,gpu=240,bandwidth=90,rlvr=300,cluster_check=150,${GPU_CHECK_LIMITS:-}"
limit=600
failed=0
mkdir -p "$out"
: > "$out/steps.jsonl"

# run CMD...: one command of a step, echoed; in a dry run only echoed; a program under the step's time limit
run() {
  echo "+ $*"
  [ "$dry" = 1 ] && return 0
  local rc
  if declare -F "$1" > /dev/null; then "$@"; else timeout -k 15 "$limit" "$@"; fi
  rc=$?
  [ "$rc" = 0 ] || { echo "gpu_check: exit status $rc: $*" >&2; step_rc=$rc; }
  return "$rc"
}

# limit_of NAME: the step's seconds from $limits (the last NAME=S wins)
limit_of() {
  local item found=600
  for item in ${limits//,/ }; do
    case "$item" in "$1="*) found="${item#*=}" ;; esac
  done
  echo "$found"
}

# step NAME FUNCTION: time a step, record it, go on whatever it did
step() {
  local name="$1" fn="$2" t0 rc ms
  case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
  limit=$(limit_of "$name")
  echo "== gpu_check: $name (limit ${limit} s)" >&2
  t0=$(date +%s%N)
  step_rc=0  # a failed command fails its step, whatever the step's last command did (run sets it)
  "$fn" > >(tee "$out/$name.log") 2>&1
  rc=$?
  [ "$rc" != 0 ] || rc=$step_rc
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '{"step": "%s", "status": %d, "seconds": %d.%03d, "dry_run": %s}\n' "$name" "$rc" $((ms / 1000)) \
    $((ms % 1000)) "$([ "$dry" = 1 ] && echo true || echo false)" >> "$out/steps.jsonl"
  [ "$rc" = 0 ] || { failed=1; echo "gpu_check: step $name failed ($rc); see $out/$name.log" >&2; }
}

do_env() {
  run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  run "$python" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

# link_outer_site: the venv's .pth naming the site-packages of the python it was made from
link_outer_site() {
  local inner
  inner=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
  "$python" -c "import site; print('\n'.join(site.getsitepackages()))" > "$inner/zz_outer_site.pth" || return 1
  cat "$inner/zz_outer_site.pth"
}

do_install() {
  if [ "$dry" = 0 ] && ! ls "$wheels"/*.whl > /dev/null 2>&1; then
    echo "no wheels in $wheels: run tools/fetch_gpu_wheels.sh on a machine with the package index, carry $wheels" >&2
    return 1
  fi
  run "$python" -m venv --system-site-packages "$venv"
  # a venv made from a venv's python sees its *base* interpreter's packages, not that venv's (the GPU image's
  # python3 is /opt/torch/.venv, holding its CUDA torch): a .pth in the new venv names the outer site-packages
  run link_outer_site
  run "$py" -c "import torch; print('torch from', torch.__file__)"
  run "$py" -m pip install --disable-pip-version-check --no-index --no-deps "$wheels"/*.whl
  run "$py" -c "import megatron.core, mpi4py.MPI, rollhpc.cli, rollhpc.workers.megatron_policy; print('imports ok')"
}

do_gpu() {
  run env ROLLHPC_GPU_RESULTS="$out/gpu_tests.jsonl" "$py" -m pytest -m gpu tests/world/test_gpu.py -p no:cacheprovider \
    -q -o addopts="" --timeout 300 --junitxml "$out/gpu_tests.xml"
}

do_bandwidth() {
  run "$py" tools/gpu_bandwidth.py --out "$out/bandwidth.json"
}

do_rlvr() {
  # the same 20 steps twice, the colocated roles taking turns (offload on: the trainer's state goes to host memory
  # while the engine generates) and both resident; each run's metrics.jsonl has its weights' sha256 at the end
  local offload
  for offload in true false; do
    run "$py" -m rollhpc.cli train quickstart --overwrite "run.name=offload-$offload" "run.output_dir=$out/rlvr" \
      cluster.nodes=1 cluster.gpus_per_node=1 \
      roles.train.gpus_per_proc=1 "roles.train.devices=[0]" roles.train.options.dtype=bfloat16 \
      roles.generate.gpus_per_proc=1 "roles.generate.devices=[0]" roles.generate.options.engine=torch \
      roles.generate.options.dtype=bfloat16 "pipeline.options.offload=$offload" pipeline.options.weight_sync=auto \
      pipeline.options.weight_sync_verify_every=1 pipeline.options.steps=20 pipeline.options.eval_every=10
  done
  run "$py" -m rollhpc.cli plan quickstart cluster.nodes=1 cluster.gpus_per_node=1 roles.train.gpus_per_proc=1 \
    "roles.train.devices=[0]" roles.generate.gpus_per_proc=1 "roles.generate.devices=[0]" \
    pipeline.options.offload=true
}

do_cluster_check() {
  run "$py" -m rollhpc.cli train cluster_check --overwrite "run.output_dir=$out/cluster_check" \
    check.experiment=quickstart cluster.nodes=1 cluster.gpus_per_node=1 \
    roles.train.gpus_per_proc=1 "roles.train.devices=[0]" roles.train.options.dtype=bfloat16 \
    roles.generate.gpus_per_proc=1 "roles.generate.devices=[0]" roles.generate.options.engine=torch \
    roles.generate.options.dtype=bfloat16 pipeline.options.offload=true
}

cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
step env do_env
step install do_install
step gpu do_gpu
step bandwidth do_bandwidth
step rlvr do_rlvr
step cluster_check do_cluster_check
if [ "$dry" = 0 ]; then  # one JSON of it all: OUT/summary.json
  "$([ -x "$py" ] && echo "$py" || echo "$python")" tools/gpu_check_summary.py "$out" > /dev/null \
    || echo "gpu_check: no summary.json (tools/gpu_check_summary.py failed)" >&2
fi
echo "gpu_check: results in $out (steps.jsonl$([ "$dry" = 1 ] && echo '; dry run: nothing was run' \
  || echo ', summary.json'))" >&2
exit "$failed"
