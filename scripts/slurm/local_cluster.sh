#!/usr/bin/env bash
# A throw-away single-node SLURM cluster on this machine, for tests and for trying the
# sbatch scripts without a real cluster (Debian/Ubuntu, run as root).
#
#   scripts/slurm/local_cluster.sh install          # apt-get install slurm-wlm munge if missing
#   scripts/slurm/local_cluster.sh start DIR [CPUS] # write DIR/slurm.conf, start munged,
#                                                   # slurmctld and slurmd (one node, CPUS cpus)
#   export SLURM_CONF=DIR/slurm.conf                # then sbatch/squeue/scontrol use it
#   scripts/slurm/local_cluster.sh stop DIR         # stop the daemons started by `start`
#
# Everything lives in DIR (configuration, munge key and socket, state, spool, logs, pid
# files): nothing under /etc is changed and `stop` ends exactly the processes `start`
# recorded. Chosen for a container: process tracking by parent pid (proctrack/linuxproc),
# no task plugin, no cgroups, no accounting database (completed jobs stay visible to
# `scontrol show job` for MinJobAge seconds). The node is named after this machine's
# short host name (jobs such as fairseq's rendezvous resolve node names) and advertises CPUS cpus (default 4; more than the machine has is allowed, jobs then share
# cores), so array tasks and 2-task training steps can run side by side.
set -euo pipefail

die() { echo "local_cluster.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null; }

install() {
  have_slurm && return 0
  [[ $(id -u) == 0 ]] || die "installing slurm-wlm and munge needs root"
  command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm and munge by hand"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null || die "apt-get install slurm-wlm munge failed"
  have_slurm || die "slurm-wlm installed but slurmctld/slurmd/munged/sbatch not found"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

start() {
  local dir=$1 cpus=${2:-4}
  have_slurm || die "SLURM is not installed (run: $0 install)"
  [[ $(id -u) == 0 ]] || die "the local cluster runs its daemons as root"
  [[ ! -e $dir/slurmctld.pid ]] || die "$dir already holds a running cluster (stop it first)"
  # (slurm.conf's parser splits a path at spaces, and cannot quote one)
  local whole=$dir
  [[ $whole == /* ]] || whole=$PWD/$dir
  [[ $whole != *[[:space:]\"#=]* ]] \
    || die "'$whole': SLURM's configuration cannot hold a path with spaces, quotes, # or =: choose another folder"
  mkdir -p "$dir"/{state,spool,munge,log}
  dir=$(cd "$dir" && pwd)
  chmod 700 "$dir" "$dir/munge"

  # munge: our own key and socket, so the system's munge (if any) is left alone
  head -c 1024 /dev/urandom > "$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  local socket=$dir/munge/munge.socket
  munged --foreground --force --key-file="$dir/munge/munge.key" --socket="$socket" \
    --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" \
    --log-file="$dir/log/munged.log" > "$dir/log/munged.out" 2>&1 &
  echo $! > "$dir/munged.pid"
  wait_for 20 munged test -S "$socket" || die "munged did not start (see $dir/log/munged.log)"

  local host
  host=$(hostname -s)
  cat > "$dir/slurm.conf" <<EOF
# single-node test cluster written by local_cluster.sh
ClusterName=tpplocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (120 s
# by default): short here so that requeue tests do not idle
AuthInfo=socket=$socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/state/slurmctld.pid
SlurmdPidFile=$dir/spool/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
# a scheduling pass every 2 s (default 60): a requeued job starts soon after its delay
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -D -i -f "$SLURM_CONF" > "$dir/log/slurmctld.out" 2>&1 &
  echo $! > "$dir/slurmctld.pid"
  slurmd -D -N "$host" -f "$SLURM_CONF" > "$dir/log/slurmd.out" 2>&1 &
  echo $! > "$dir/slurmd.pid"
  if ! wait_for 60 "node" bash -c 'sinfo -h -N -o %t | grep -qE "^(idle|mix|alloc)"'; then
    echo "--- slurmctld.log" >&2; tail -n 20 "$dir/log/slurmctld.log" >&2 || true
    echo "--- slurmd.log" >&2; tail -n 20 "$dir/log/slurmd.log" >&2 || true
    stop "$dir"
    die "the local node did not come up"
  fi
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local dir=$1 name pid
  for name in slurmd slurmctld munged; do
    [[ -f $dir/$name.pid ]] || continue
    pid=$(cat "$dir/$name.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      wait_for 15 "$name exit" bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/$name.pid"
  done
}

case ${1:-} in
  install) install ;;
  start) [[ $# -ge 2 ]] || die "usage: $0 start DIR [CPUS]"; start "$2" "${3:-4}" ;;
  stop) [[ $# -eq 2 ]] || die "usage: $0 stop DIR"; stop "$2" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
