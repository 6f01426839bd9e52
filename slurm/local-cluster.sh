#!/usr/bin/env bash
# local-cluster.sh - a throw-away, single-host Slurm cluster on loopback, for tests and local development:
# munged + slurmctld + N x slurmd (one per simulated node, node1..nodeN), all as root, no systemd, no cgroups,
# fake GPUs as GRES. No slurmdbd: a scontrol-backed `sacct` shim stands in for accounting.
#
# Usage:
#   slurm/local-cluster.sh up     [DIR]        start (idempotent: a healthy cluster is left as it is)
#   slurm/local-cluster.sh down   [DIR]        stop every daemon and job process of this cluster
#   slurm/local-cluster.sh status [DIR]        daemons, nodes, queue; exit 0 only if healthy
#   slurm/local-cluster.sh node-crash DIR NODE SIGKILL NODE's slurmd, its slurmstepd's and their tasks
#   slurm/local-cluster.sh node-start DIR NODE (re)start NODE's slurmd (it returns to service by itself)
# Then:  source DIR/env.sh     (exports SLURM_CONF, puts DIR/bin with the sacct shim first on PATH)
#
# DIR defaults to $ROLLHPC_SLURM_DIR, else /tmp/rollhpc-slurm. Must run as root (SlurmUser=root).
# Missing Debian packages (slurmctld slurmd slurm-client munge) are installed with apt-get; package
# scripts are kept from starting system services by a policy-rc.d that exits 101.
#
# Tunables (environment variables of this script only; do not export them into a shell that runs
# sbatch/srun: SLURM_MEM_PER_NODE and SLURM_GPUS_PER_NODE are also sbatch/srun input variables):
#   SLURM_NODES=4                 simulated nodes
#   SLURM_CPUS_PER_NODE=8         CPUs declared per node (may exceed the real cores)
#   SLURM_GPUS_PER_NODE=4         fake GPUs per node (0 = no GRES)
#   SLURM_MEM_PER_NODE=2000       RealMemory (MB) declared per node
#   SLURM_CTLD_PORT=6817          slurmctld port
#   SLURM_SLURMD_PORT_BASE=17000  nodeI's slurmd listens on BASE+I
#   SLURM_SLURMD_TIMEOUT=5        seconds before a silent slurmd's node is marked DOWN
#   SLURM_INSTALL=1               0 = fail instead of installing missing packages
#   SLURM_UP_TIMEOUT=60           seconds to wait for all nodes to become idle
#   SLURM_KEEP_STATE=0            1 = keep slurmctld state (job ids, queue) across restarts
#   SLURM_TASK_PLUGIN=task/none   task/affinity: srun binds tasks to cores (--cpu-bind), as clusters do; then
#                                 declare no more CPUs per node than this machine has (nproc), or srun fails
#                                 "Unable to layout tasks on given cpus"
#
# MPI under srun: mpi4py + the `mpich` wheel with `srun --mpi=pmi2` (also across het groups,
# `srun --mpi=pmi2 --het-group=0 ... : --het-group=1 ...` is one MPI_COMM_WORLD).
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/$(basename "${BASH_SOURCE[0]}")"
PKGS=(slurmctld slurmd slurm-client munge)

log() { printf '[local-cluster %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }
alive() {  # PID exists and is not a zombie
  [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] || return 1
  local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}
pid_in() { [ -s "$1" ] && cat "$1" 2>/dev/null || true; }
now() { date +%s.%N; }
since() { awk "BEGIN{printf \"%.2f\", $(now)-$1}"; }
re_escape() { printf '%s' "$1" | sed 's/[][\.*^$+?(){}|/]/\\&/g'; }

# set_dir DIR: the cluster's paths (DIR is created only by `up`)
set_dir() {
  DIR="$1"
  [ -d "$DIR" ] && DIR="$(cd "$DIR" && pwd -P)"
  CONF="$DIR/etc/slurm.conf"
  MUNGE_SOCK="$DIR/munge-run/munge.socket"
  export SLURM_CONF="$CONF"
  # we talk to our own cluster only, whatever job/allocation this script runs in
  unset SLURM_JOB_ID SLURM_JOBID
}

# ------------------------------------------------------------------ install
install_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "${SLURM_INSTALL:-1}" = 1 ] || die "missing Debian packages: ${missing[*]} (SLURM_INSTALL=0)"
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
  log "installing: ${missing[*]}"
  local t0; t0=$(now)
  # package scripts must not start system-wide munge/slurm services: policy-rc.d exit 101 while we install
  local policy=/usr/sbin/policy-rc.d backup=""
  if [ -e "$policy" ]; then backup=$(mktemp); cp -p "$policy" "$backup"; fi
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"
  local rc=0
  (
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || log "apt-get update failed (trying the install anyway)"
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  ) > "/tmp/local-cluster-apt.$$.log" 2>&1 || rc=$?
  if [ -n "$backup" ]; then mv -f "$backup" "$policy"; else rm -f "$policy"; fi
  if [ "$rc" != 0 ]; then
    tail -20 "/tmp/local-cluster-apt.$$.log" >&2
    die "apt-get install ${missing[*]} failed (rc $rc, log /tmp/local-cluster-apt.$$.log)"
  fi
  rm -f "/tmp/local-cluster-apt.$$.log"
  log "installed in $(since "$t0")s"
}

# ------------------------------------------------------------------ health
node_names() { sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$CONF" 2>/dev/null; }
healthy() {
  [ -f "$CONF" ] || return 1
  alive "$(pid_in "$DIR/run/munged.pid")" || return 1
  alive "$(pid_in "$DIR/run/slurmctld.pid")" || return 1
  local n names; names=$(node_names); [ -n "$names" ] || return 1
  for n in $names; do alive "$(pid_in "$DIR/run/slurmd-$n.pid")" || return 1; done
  scontrol ping >/dev/null 2>&1
}

cmd_status() {
  set_dir "$1"
  [ -f "$CONF" ] || { echo "no cluster in $DIR"; return 3; }
  local d p n
  printf 'cluster %s\n  daemons:' "$DIR"
  for d in munged slurmctld; do
    p=$(pid_in "$DIR/run/$d.pid"); alive "$p" && printf ' %s=%s' "$d" "$p" || printf ' %s=DEAD' "$d"
  done
  for n in $(node_names); do
    p=$(pid_in "$DIR/run/slurmd-$n.pid"); alive "$p" && printf ' %s=%s' "$n" "$p" || printf ' %s=DEAD' "$n"
  done
  echo
  if scontrol ping >/dev/null 2>&1; then
    sinfo -N -o '%N %T %c %m %G' 2>/dev/null | sed 's/^/  /'
    squeue 2>/dev/null | sed 's/^/  /'
  fi
  echo "  use: source $DIR/env.sh"
  healthy
}

# ------------------------------------------------------------------ up
write_config() {
  local nodes=$1 cpus=$2 gpus=$3 mem=$4 ctld_port=$5 port_base=$6 slurmd_timeout=$7
  local nodelist="node[1-$nodes]"; [ "$nodes" -eq 1 ] && nodelist=node1
  local gres_attr="" i
  # a fresh cluster's first job id: different at every start (seconds since 2026, scaled), below MaxJobId
  local FIRST_JOB_ID=$(( ($(date +%s) - 1767225600) % 600000 * 100 + 1000 ))
  if [ "$gpus" -gt 0 ]; then
    # gres/gpu wants File= to be a character/block device: clones of /dev/null (1,3), or symlinks to it
    for i in $(seq 0 $((gpus - 1))); do
      [ -c "$DIR/dev/fakegpu$i" ] && continue
      rm -f "$DIR/dev/fakegpu$i"
      mknod "$DIR/dev/fakegpu$i" c 1 3 2>/dev/null || ln -s /dev/null "$DIR/dev/fakegpu$i"
    done
    gres_attr="Gres=gpu:$gpus"
  fi
  {
    cat <<EOF
# generated by slurm/local-cluster.sh - single-host test cluster in $DIR
ClusterName=rollhpc
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (minimum 5) is also the delay before a requeued job may start again (default 120 s)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
# one TmpFS per node: several slurmd on one host would collide in a shared /tmp
TmpFS=$DIR/tmp/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no systemd, no cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=${SLURM_TASK_PLUGIN:-task/none}
JobAcctGatherType=jobacct_gather/none
# no slurmdbd: DIR/bin/sacct answers from scontrol; finished jobs are also listed in jobcomp.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
SwitchType=switch/none
MpiDefault=none
# heterogeneous jobs are started only by the backfill scheduler: run it every second
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# trust slurm.conf over the real hardware (more CPUs than exist)
SlurmdParameters=config_overrides
# a node that went DOWN for not responding comes back when its slurmd registers again
ReturnToService=2
SlurmdTimeout=$slurmd_timeout
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
# as sites set it (Slurm asks for >= 5 x MessageTimeout): when a node of a multi-node step dies, the batch node's
# slurmstepd waits about a minute for the lost node's step-completion message, and with the default 60 s Slurm
# drained that node "Kill task failed" first (bench/scale_slurm.py, 8 nodes), so the run's restart on its own
# nodes waited for a person
UnkillableStepTimeout=120
Waittime=0
MinJobAge=600
JobRequeue=1
# job ids must not restart at 1 with every fresh cluster: MPICH names its shared-memory segments after the
# PMI job/step id, and a segment left in /dev/shm by a killed job 1.0 of an earlier cluster makes the next
# job 1.0's MPI_Init spin forever
FirstJobId=$FIRST_JOB_ID
EOF
    [ "$gpus" -gt 0 ] && echo "GresTypes=gpu"
    for i in $(seq 1 "$nodes"); do
      echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port_base + i)) CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem $gres_attr State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } > "$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  if [ "$gpus" -gt 0 ]; then
    printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/dev/fakegpu[0-%d]\n' "$nodelist" "$DIR" $((gpus - 1)) \
      > "$DIR/etc/gres.conf"
  else
    rm -f "$DIR/etc/gres.conf"
  fi
}

write_sacct_shim() {
  cat > "$DIR/bin/sacct" <<'SHIM_EOF'
#!/usr/bin/env bash
# sacct shim - a minimal `sacct` for a Slurm cluster WITHOUT slurmdbd, answered from `scontrol show job -o`
# (so only jobs younger than MinJobAge are known). Enough for submitit's watcher:
#   sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
# Supported: -j/--jobs (repeatable, comma lists), -o/--format (fields: JobID JobIDRaw JobName State NodeList
# ExitCode Restarts Partition Elapsed), -P/--parsable2, -p/--parsable, -n/--noheader, -X/--allocations
# (no-op: steps are never listed). Het job components are listed as ID+OFFSET, array tasks as ID_TASK.
set -uo pipefail
fmt="JobID,JobName,Partition,State,ExitCode"; jobs=(); parsable=0; trail=""; header=1
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) IFS=, read -ra a <<<"$2"; jobs+=("${a[@]}"); shift 2 ;;
    -j*) IFS=, read -ra a <<<"${1#-j}"; jobs+=("${a[@]}"); shift ;;
    --jobs=*) IFS=, read -ra a <<<"${1#--jobs=}"; jobs+=("${a[@]}"); shift ;;
    -o|--format) fmt="$2"; shift 2 ;;
    --format=*) fmt="${1#--format=}"; shift ;;
    -P|--parsable2) parsable=1; shift ;;
    -p|--parsable) parsable=1; trail="|"; shift ;;
    -n|--noheader) header=0; shift ;;
    -X|--allocations|-a|--allusers|-D|--duplicates) shift ;;
    -S|--starttime|-E|--endtime|-u|--user|-s|--state|-M|--clusters) shift 2 ;;
    *) shift ;;
  esac
done
if [ "${#jobs[@]}" -eq 0 ]; then
  recs=$(scontrol show job -o 2>/dev/null | grep '^JobId=')
else
  recs=""
  for j in "${jobs[@]}"; do
    j=${j%%.*}; j=${j%%_*}; j=${j%%+*}
    recs+=$(scontrol show job -o "$j" 2>/dev/null | grep '^JobId=')$'\n'
  done
fi
printf '%s\n' "$recs" | awk -v fmt="$fmt" -v parsable="$parsable" -v trail="$trail" -v header="$header" '
BEGIN { n = split(fmt, F, ","); sep = parsable ? "|" : " "
  if (header) { line = ""; for (i = 1; i <= n; i++) line = line (i > 1 ? sep : "") F[i]; print line trail } }
NF == 0 { next }
{ delete K
  for (i = 1; i <= NF; i++) { p = index($i, "="); if (p > 1) { k = substr($i, 1, p - 1); if (!(k in K)) K[k] = substr($i, p + 1) } }
  id = K["JobId"]
  if (("ArrayJobId" in K) && K["ArrayJobId"] != "") {
    t = K["ArrayTaskId"]; id = K["ArrayJobId"] "_" (t ~ /^[0-9]+$/ ? t : "[" t "]")
  } else if (("HetJobId" in K) && K["HetJobId"] != "") { id = K["HetJobId"] "+" K["HetJobOffset"] }
  if (seen[id]++) next
  line = ""
  for (i = 1; i <= n; i++) {
    f = tolower(F[i]); sub(/%.*/, "", f)
    if (f == "jobid") v = id; else if (f == "jobidraw") v = K["JobId"]
    else if (f == "state") v = K["JobState"]
    else if (f == "nodelist") v = (K["NodeList"] == "(null)" ? "None assigned" : K["NodeList"])
    else if (f == "exitcode") v = K["ExitCode"]; else if (f == "jobname") v = K["JobName"]
    else if (f == "restarts") v = K["Restarts"]; else if (f == "partition") v = K["Partition"]
    else if (f == "elapsed") v = K["RunTime"]; else v = ""
    line = line (i > 1 ? sep : "") v
  }
  print line trail
}'
SHIM_EOF
  chmod 755 "$DIR/bin/sacct"
}

cmd_up() {
  local nodes="${SLURM_NODES:-4}" cpus="${SLURM_CPUS_PER_NODE:-8}" gpus="${SLURM_GPUS_PER_NODE:-4}"
  local mem="${SLURM_MEM_PER_NODE:-2000}" ctld_port="${SLURM_CTLD_PORT:-6817}"
  local port_base="${SLURM_SLURMD_PORT_BASE:-17000}" slurmd_timeout="${SLURM_SLURMD_TIMEOUT:-5}"
  local up_timeout="${SLURM_UP_TIMEOUT:-60}" keep_state="${SLURM_KEEP_STATE:-0}"
  [ "$(id -u)" -eq 0 ] || die "must run as root (SlurmUser=root; slurmd needs root)"
  mkdir -p "$1"
  set_dir "$1"
  install_packages

  if healthy; then
    log "cluster in $DIR is already up"
    cmd_status "$DIR"
    return 0
  fi
  if ls "$DIR"/run/*.pid >/dev/null 2>&1; then
    log "stale or partial cluster in $DIR: stopping it first"
    cmd_down "$DIR" 2>/dev/null || true
  elif [ -f "$CONF" ]; then
    cmd_down "$DIR" 2>/dev/null || true  # stopped before; catches daemons that lost their pid file
  fi

  mkdir -p "$DIR"/{etc,bin,log,run,state,spool,tmp,dev,munge,munge-run}
  chmod 700 "$DIR/munge"; chmod 755 "$DIR/munge-run"  # munged insists; clients must enter the socket dir
  chmod 755 "$DIR"
  if [ "$keep_state" != 1 ]; then
    rm -rf "${DIR:?}/state/"* "${DIR:?}/spool/"* "${DIR:?}/tmp/"*
    if ls "$DIR"/log/* >/dev/null 2>&1; then rm -rf "$DIR/log.prev"; mv "$DIR/log" "$DIR/log.prev"; mkdir "$DIR/log"; fi
  fi
  local i
  for i in $(seq 1 "$nodes"); do mkdir -p "$DIR/spool/node$i" "$DIR/tmp/node$i"; chmod 1777 "$DIR/tmp/node$i"; done
  if [ ! -s "$DIR/munge/munge.key" ]; then  # a key private to this cluster
    mungekey --create --keyfile="$DIR/munge/munge.key" --force >/dev/null 2>&1 \
      || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
  fi
  write_config "$nodes" "$cpus" "$gpus" "$mem" "$ctld_port" "$port_base" "$slurmd_timeout"
  write_sacct_shim
  cat > "$DIR/env.sh" <<EOF
# source me: clients of the local Slurm cluster in $DIR
export SLURM_CONF=$CONF
export PATH=$DIR/bin:\$PATH
EOF

  local t0; t0=$(now)
  munged --socket="$MUNGE_SOCK" --key-file="$DIR/munge/munge.key" --log-file="$DIR/log/munged.log" \
    --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed" </dev/null >/dev/null 2>&1 \
    || die "munged failed: $(tail -3 "$DIR/log/munged.log" 2>/dev/null)"
  for _ in $(seq 1 50); do [ -S "$MUNGE_SOCK" ] && break; sleep 0.1; done
  munge -S "$MUNGE_SOCK" -n </dev/null | unmunge -S "$MUNGE_SOCK" >/dev/null || die "munge self-test failed"

  local ctld_args=(-f "$CONF"); [ "$keep_state" = 1 ] || ctld_args=(-c -i -f "$CONF")
  slurmctld "${ctld_args[@]}" </dev/null >/dev/null 2>&1 \
    || die "slurmctld failed: $(tail -5 "$DIR/log/slurmctld.log" 2>/dev/null)"
  for _ in $(seq 1 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
  scontrol ping >/dev/null 2>&1 || die "slurmctld not answering on port $ctld_port: $(tail -5 "$DIR/log/slurmctld.log")"

  for i in $(seq 1 "$nodes"); do
    slurmd -f "$CONF" -N "node$i" </dev/null >/dev/null 2>&1 \
      || die "slurmd node$i failed: $(tail -5 "$DIR/log/slurmd-node$i.log" 2>/dev/null)"
  done
  local states="" ok=0
  for _ in $(seq 1 $((up_timeout * 5))); do
    states=$(sinfo -h -N -o '%T' 2>/dev/null | sort | uniq -c | awk '{print $2"="$1}' | tr '\n' ' ')
    [ "$states" = "idle=$nodes " ] && { ok=1; break; }
    sleep 0.2
  done
  [ "$ok" = 1 ] || { sinfo -N >&2 || true; die "nodes not idle after ${up_timeout}s (${states:-no answer}); logs in $DIR/log"; }
  log "Slurm $(sinfo --version | awk '{print $2}') up in $(since "$t0")s: $nodes nodes x $cpus CPUs x $gpus GPUs, slurmctld port $ctld_port, slurmd ports $((port_base + 1))-$((port_base + nodes))"
  cmd_status "$DIR"
}

# ------------------------------------------------------------------ down
stop_pids() {  # stop_pids NAME=PID ...: SIGTERM, wait up to 10 s, then SIGKILL
  local kv pending
  for kv in "$@"; do alive "${kv#*=}" && kill -TERM "${kv#*=}" 2>/dev/null; done
  for _ in $(seq 1 100); do
    pending=0
    for kv in "$@"; do alive "${kv#*=}" && pending=1; done
    [ "$pending" = 0 ] && break
    sleep 0.1
  done
  for kv in "$@"; do
    alive "${kv#*=}" && { kill -KILL "${kv#*=}" 2>/dev/null; log "killed ${kv%%=*} (pid ${kv#*=}) with SIGKILL"; }
  done
  return 0
}

cmd_down() {
  set_dir "$1"
  [ -d "$DIR" ] || { log "no cluster directory $DIR: nothing to do"; return 0; }
  local t0; t0=$(now)
  local ctld; ctld=$(pid_in "$DIR/run/slurmctld.pid")

  # 1. cancel all jobs while the controller still answers, give them a few seconds to end
  if alive "$ctld" && scontrol ping >/dev/null 2>&1 && [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
    scancel --full $(squeue -h -o %i 2>/dev/null | sed 's/+.*//' | sort -u) 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
  fi

  # 2. daemons from their pid files: slurmd's, slurmctld, munged
  local f args=()
  for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && args+=("$(basename "$f" .pid)=$(pid_in "$f")"); done
  [ "${#args[@]}" -gt 0 ] && stop_pids "${args[@]}"
  [ -n "$ctld" ] && stop_pids "slurmctld=$ctld"
  local m; m=$(pid_in "$DIR/run/munged.pid"); [ -n "$m" ] && stop_pids "munged=$m"
  rm -f "$DIR"/run/*.pid

  # 3. fallback: daemons of THIS cluster without (valid) pid files, found by the config/socket path
  #    on their command line (slurmctld/slurmd -f DIR/etc/slurm.conf, munged --socket=DIR/munge-run/...)
  local rest
  rest=$( { pgrep -f -- "^([^ ]*/)?(slurmctld|slurmd) (.* )?-f $(re_escape "$CONF")( |$)";
            pgrep -f -- "^([^ ]*/)?munged .*--socket=$(re_escape "$MUNGE_SOCK")( |$)"; } | tr '\n' ' ' || true)
  rest="${rest% }"
  if [ -n "$rest" ]; then
    log "stopping daemons without pid file: $rest"
    # shellcheck disable=SC2086
    kill -TERM $rest 2>/dev/null || true; sleep 0.5
    # shellcheck disable=SC2086
    kill -KILL $rest 2>/dev/null || true
  fi

  # 4. orphans: slurmstepd's and job tasks of this cluster outlive a killed slurmd; they carry
  #    SLURM_CONF=DIR/etc/slurm.conf in their environment (never touch this script's own ancestors)
  local self_tree=" $$ " p=$$ e pid env_ exe orphans=()
  while [ "$p" -gt 1 ]; do p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || echo 1); self_tree+="$p "; done
  for e in /proc/[0-9]*/environ; do
    pid=${e#/proc/}; pid=${pid%/environ}
    [[ "$self_tree" == *" $pid "* ]] && continue
    env_=$( { tr '\0' '\n' < "$e"; } 2>/dev/null ) || continue
    grep -qxF "SLURM_CONF=$CONF" <<<"$env_" || continue
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null || true)
    if [[ "$exe" == *slurmstepd* || "$exe" == */slurmd || "$exe" == */slurmctld ]] || grep -q '^SLURM_JOB_ID=' <<<"$env_"; then
      orphans+=("$pid")
    fi
  done
  if [ "${#orphans[@]}" -gt 0 ]; then
    log "killing leftover step/job processes of this cluster: ${orphans[*]}"
    kill -KILL "${orphans[@]}" 2>/dev/null || true
    sleep 0.2
  fi
  # 5. MPICH shared-memory segments of jobs that ended by a crash or an abort (MPI_Finalize would have
  #    removed them); only those no live process maps (a real cluster's epilog cleans /dev/shm)
  local seg mapped
  mapped=$(grep -ho '/dev/shm/mpich_shm_[^ ]*' /proc/[0-9]*/maps 2>/dev/null | sort -u || true)
  for seg in /dev/shm/mpich_shm_*; do
    [ -e "$seg" ] || continue
    grep -qxF "$seg" <<<"$mapped" || rm -f "$seg"
  done
  log "cluster in $DIR stopped in $(since "$t0")s"
}

# ------------------------------------------------------------------ node crash / start
node_stepds() {  # slurmstepd's of NODE: they inherit an fd on log/slurmd-NODE.log
  local logf="$DIR/log/slurmd-$1.log" p fd
  for p in /proc/[0-9]*; do
    [[ "$(readlink "$p/exe" 2>/dev/null)" == *slurmstepd* ]] || continue
    for fd in "$p"/fd/*; do
      [ "$(readlink "$fd" 2>/dev/null)" = "$logf" ] && { echo "${p#/proc/}"; break; }
    done
  done
  # not the last test's status: a slurmstepd of another node, scanned last, would fail the caller (pipefail)
  return 0
}
descendants() {  # all descendants of the given pids
  [ $# -gt 0 ] || return 0
  ps -e -o pid=,ppid= | awk -v roots=" $* " '
    { parent[$1] = $2; pids[NR] = $1 }
    END { split(roots, r, " "); for (i in r) in_tree[r[i]] = 1
          do { changed = 0
               for (i in pids) { q = pids[i]; if (!(q in in_tree) && (parent[q] in in_tree)) { in_tree[q] = 1; changed = 1; print q } } }
          while (changed) }'
}

cmd_node_crash() {
  set_dir "$1"; local node=$2
  [ -f "$CONF" ] || die "no cluster in $DIR"
  node_names | grep -qxF "$node" || die "no node $node in $CONF"
  local sd st ds
  sd=$(pid_in "$DIR/run/slurmd-$node.pid")
  st=$(node_stepds "$node" | tr '\n' ' ')
  # shellcheck disable=SC2086
  ds=$(descendants $st | tr '\n' ' ')
  # freeze everything first so nothing can react (a task cannot report its death), then kill
  # shellcheck disable=SC2086
  kill -STOP $sd $st $ds 2>/dev/null || true
  # shellcheck disable=SC2086
  kill -KILL $sd $st $ds 2>/dev/null || true
  rm -f "$DIR/run/slurmd-$node.pid" "$DIR/spool/$node/${node}_"*
  echo "crashed $node: slurmd=${sd:-none} slurmstepd=[${st% }] tasks=[${ds% }]"
}

cmd_node_start() {
  set_dir "$1"; local node=$2
  [ -f "$CONF" ] || die "no cluster in $DIR"
  node_names | grep -qxF "$node" || die "no node $node in $CONF"
  alive "$(pid_in "$DIR/run/slurmd-$node.pid")" && { echo "$node slurmd already running"; return 0; }
  slurmd -f "$CONF" -N "$node" </dev/null >/dev/null 2>&1 \
    || die "slurmd $node failed: $(tail -5 "$DIR/log/slurmd-$node.log" 2>/dev/null)"
  for _ in $(seq 1 50); do [ -s "$DIR/run/slurmd-$node.pid" ] && break; sleep 0.1; done
  echo "started $node slurmd pid $(pid_in "$DIR/run/slurmd-$node.pid") (state: $(sinfo -h -n "$node" -o %T 2>/dev/null))"
}

# ------------------------------------------------------------------ main
default_dir="${ROLLHPC_SLURM_DIR:-/tmp/rollhpc-slurm}"
cmd="${1:-}"; [ $# -gt 0 ] && shift
case "$cmd" in
  up) cmd_up "${1:-$default_dir}" ;;
  down) cmd_down "${1:-$default_dir}" ;;
  status) cmd_status "${1:-$default_dir}" ;;
  node-crash) [ $# -eq 2 ] || { usage >&2; exit 2; }; cmd_node_crash "$1" "$2" ;;
  node-start) [ $# -eq 2 ] || { usage >&2; exit 2; }; cmd_node_start "$1" "$2" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
