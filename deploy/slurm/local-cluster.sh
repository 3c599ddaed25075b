#!/usr/bin/env bash
# A one-machine Slurm cluster for trying the scripts of this folder (and for the tests):
# munged, slurmctld and slurmd from Debian's packages (slurm-wlm, munge), run as root, with
# everything (configuration, key, state, logs, sockets) in one directory.
#
#   sudo deploy/slurm/local-cluster.sh start DIR   # prints: export SLURM_CONF=DIR/slurm.conf
#   sudo deploy/slurm/local-cluster.sh stop DIR    # cancels its jobs, stops its daemons; DIR stays
#
# Process tracking is proctrack/linuxproc (no cgroups needed); one node, named after this
# host, with its CPUs and memory, each core shared by up to 8 jobs (a syncer and several
# learners fit a laptop); jobs may be requeued (JobRequeue=1). Ports: any
# free pair (SLURM_LOCAL_PORT to choose the first). Not a production configuration.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)

stop() {
    # Cancel this cluster's jobs first: a job's processes outlive slurmd (bounded wait).
    if [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        SLURM_CONF=$dir/slurm.conf scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do
            [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h -t R,CG 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for name in slurmd slurmctld munged; do
        if [ -s "$dir/$name.pid" ]; then
            kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
        fi
    done
    for name in slurmd slurmctld munged; do
        for _ in $(seq 50); do
            [ -s "$dir/$name.pid" ] && kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || break
            sleep 0.1
        done
        [ -s "$dir/$name.pid" ] && kill -9 "$(cat "$dir/$name.pid")" 2>/dev/null || true
        rm -f "$dir/$name.pid"
    done
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    [ "$(id -u)" = 0 ] || { echo "$0: run as root (slurmd starts jobs as their users)" >&2; exit 1; }
    for cmd in munged slurmctld slurmd sinfo; do
        command -v "$cmd" >/dev/null || {
            echo "$0: $cmd not found: apt-get install slurmctld slurmd slurm-client munge" >&2
            exit 1
        }
    done
    mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
    chmod 700 "$dir/munge"
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/seed"
    local host cpus mem ctl_port node_port
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    ctl_port=${SLURM_LOCAL_PORT:-$(free_port)}
    node_port=$(free_port)
    cat > "$dir/slurm.conf" <<CONF
ClusterName=diloco-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmdPort=$node_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=15
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerParameters=sched_interval=1
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" -i
    slurmd -f "$SLURM_CONF"
    for _ in $(seq 150); do
        state=$(sinfo -h -N -o %t 2>/dev/null | head -n1)
        case "$state" in idle|mix|alloc) echo "export SLURM_CONF=$SLURM_CONF"; return 0 ;; esac
        sleep 0.2
    done
    echo "$0: the node did not come up (state '${state:-none}'); logs in $dir/log" >&2
    stop
    exit 1
}

case "$action" in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
