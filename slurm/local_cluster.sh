#!/usr/bin/env bash
# Start/stop a real single-node Slurm cluster (Debian 12, Slurm 22.05) as root, without systemd.
#   bash slurm/local_cluster.sh start [--accounting]   # idempotent; --accounting adds MariaDB + slurmdbd
#   bash slurm/local_cluster.sh stop | status
# Env: SLURM_LOCAL_CPUS (4), SLURM_LOCAL_MEM (MB, 8000), SLURM_LOCAL_TIMEOUT (s, 90),
#      SLURM_LOCAL_STATE (PID/log dir, /var/run/trainbench-slurm), SLURM_LOCAL_PARTITION (debug).
set -uo pipefail

CPUS=${SLURM_LOCAL_CPUS:-4}
MEM=${SLURM_LOCAL_MEM:-8000}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-90}
STATE=${SLURM_LOCAL_STATE:-/var/run/trainbench-slurm}
PART=${SLURM_LOCAL_PARTITION:-debug}
HOST=$(hostname -s)
MARK="# written by trainbench slurm/local_cluster.sh"
DB_PASS=trainbench-slurm   # local-only DB user, reachable only via localhost

die() { echo "local_cluster: $*" >&2; exit 1; }

# A daemon counts as alive only if /proc/PID/stat exists, is not a zombie, and its comm matches:
# PID 1 here reaps late, so `kill -0` succeeds on zombies; comm guards against PID reuse.
alive() {  # alive NAME -> 0 if the recorded PID of NAME is a live NAME process
  local pid comm st
  pid=$(cat "$STATE/$1.pid" 2>/dev/null) || return 1
  [[ -r /proc/$pid/stat ]] || return 1
  read -r _ comm st _ < "/proc/$pid/stat" 2>/dev/null || return 1
  [[ $st != Z && $st != X && $comm == "($2)" ]]
}

# Launch a daemon in the foreground mode under setsid (own session, so the caller's job control
# cannot kill it) and record its PID; exec keeps $! == the daemon's PID.
launch() {  # launch NAME CMD...
  local name=$1; shift
  setsid "$@" >>"$STATE/$name.out" 2>&1 < /dev/null &
  echo $! > "$STATE/$name.pid"
}

wait_for() {  # wait_for SECONDS CMD... : poll CMD (command or function) every 0.5 s
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || return 1
    sleep 0.5
  done
}

# name:comm pairs, in stop order (comm is truncated to 15 chars by the kernel).
DAEMONS="slurmd:slurmd slurmctld:slurmctld slurmdbd:slurmdbd mariadb:mariadbd munge:munged"

install_pkgs() {
  local missing=() p
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  # Keep package postinst scripts from starting services themselves (we start them by hand).
  local made=0
  [[ -e /usr/sbin/policy-rc.d ]] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made=1; }
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    > "$STATE/apt.log" 2>&1
  local rc=$?
  ((made)) && rm -f /usr/sbin/policy-rc.d
  ((rc == 0)) || die "apt-get install ${missing[*]} failed (see $STATE/apt.log)"
}

write_conf() {  # write_conf ACCOUNTING(0|1)
  local f=/etc/slurm/slurm.conf acct="accounting_storage/none" gather="jobacct_gather/none"
  # Never silently clobber a slurm.conf someone else wrote.
  [[ -f $f ]] && ! grep -qF "$MARK" "$f" && cp -n "$f" "$f.orig"
  if (($1)); then acct="accounting_storage/slurmdbd"; gather="jobacct_gather/linux"; fi
  cat > "$f" <<EOF
$MARK
ClusterName=trainbench
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
MailProg=/bin/true
MpiDefault=none
# cgroup tracking: linuxproc lets background processes escape the end of a job.
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# config_overrides: trust CPUs= below even if the box has fewer cores (no drain), so that
# e.g. 2 jobs of 2 tasks fit at once on a 2-core machine.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
AccountingStorageType=$acct
AccountingStorageHost=localhost
JobAcctGatherType=$gather
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # Without cgroup.conf, slurmstepd fails "cgroup namespace 'freezer' not mounted" and drains the node.
  printf '%s\nCgroupPlugin=autodetect\nCgroupMountpoint=/sys/fs/cgroup\n' "$MARK" > /etc/slurm/cgroup.conf
  if (($1)); then
    cat > /etc/slurm/slurmdbd.conf <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 /etc/slurm/slurmdbd.conf   # slurmdbd refuses a world-readable file with a password
  fi
}

dead() { ! alive "$@"; }
no_jobs() { [[ -z $(squeue -h -o %A 2>/dev/null) ]]; }
node_idle() { [[ $(sinfo -h -o %T 2>/dev/null) == idle ]]; }
node_up() { [[ $(sinfo -h -o %T 2>/dev/null) =~ ^(idle|mixed|allocated|completing)$ ]]; }  # busy counts as up
# A DRAIN saved in slurmctld state survives restarts (ReturnToService=2 does not clear it): resume.
node_ready() {
  node_idle && return 0
  [[ $(sinfo -h -o %T 2>/dev/null) == drain* ]] && scontrol update NodeName="$HOST" State=RESUME 2>/dev/null
  return 1
}

start() {
  local acct=0 t0=$SECONDS
  case ${1:-} in --accounting) acct=1 ;; "") ;; *) die "unknown option '$1' (use --accounting)" ;; esac
  [[ $(id -u) == 0 ]] || die "must run as root"
  [[ $CPUS =~ ^[1-9][0-9]*$ && $MEM =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS/SLURM_LOCAL_MEM must be positive integers"
  mkdir -p "$STATE" || die "cannot create $STATE"
  # Idempotent: up and healthy (with accounting if asked for) -> nothing to do; else restart cleanly.
  if alive slurmctld slurmctld && alive slurmd slurmd && (($(cat "$STATE/mode" 2>/dev/null || echo -1) >= acct)) && node_up; then
    echo "local slurm cluster already up (node $HOST, accounting=$(cat "$STATE/mode"))"; return 0
  fi
  stop quiet
  # On any failure below, stop what was started so the next start begins clean.
  trap 'stop quiet >/dev/null 2>&1' EXIT

  local pkgs=(slurmctld slurmd slurm-client munge)
  ((acct)) && pkgs+=(slurmdbd mariadb-server mariadb-client)
  install_pkgs "${pkgs[@]}"

  # The controller's host name must resolve, or slurmctld/slurmd refuse to start.
  getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >> /etc/hosts
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/log/munge
  write_conf $acct
  echo $acct > "$STATE/mode"

  # munge: key + runtime dir normally come from postinst/systemd; create them if absent.
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none || die "cannot write munge key"
  fi
  chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge && chmod 400 /etc/munge/munge.key
  launch munge setpriv --reuid=munge --regid=munge --init-groups munged -F
  wait_for 10 munge -n || die "munged did not come up (see $STATE/munge.out)"

  if ((acct)); then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql >>"$STATE/mariadb.out" 2>&1 \
      || die "mariadb-install-db failed (see $STATE/mariadb.out)"
    launch mariadb mariadbd --user=mysql
    wait_for 30 mariadb -e "SELECT 1" || die "mariadbd did not come up (see $STATE/mariadb.out)"
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "cannot create DB user slurm"
    launch slurmdbd slurmdbd -D
    wait_for 30 sacctmgr -n list cluster || die "slurmdbd did not come up (see $STATE/slurmdbd.out, /var/log/slurm/slurmdbd.log)"
    sacctmgr -n -P list cluster format=cluster | grep -qx trainbench \
      || sacctmgr -i add cluster trainbench >/dev/null || die "sacctmgr add cluster failed"
  fi

  # -i: ignore unreadable/old state files instead of refusing to start.
  launch slurmctld slurmctld -D -i
  wait_for 20 scontrol ping || die "slurmctld did not come up (see $STATE/slurmctld.out, /var/log/slurm/slurmctld.log)"
  launch slurmd slurmd -D
  wait_for "$TIMEOUT" node_ready \
    || die "node $HOST not idle after ${TIMEOUT}s: $(sinfo -h -o '%T %E' 2>&1) (see /var/log/slurm/)"
  trap - EXIT
  echo "local slurm cluster up in $((SECONDS - t0))s (node $HOST, CPUs=$CPUS, partition $PART, accounting=$acct)"
}

stop() {
  local quiet=${1:-} p name comm pid left=""
  # Cancel our jobs first so their slurmstepd processes end with them.
  if alive slurmctld slurmctld; then
    squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null
    wait_for 15 no_jobs
  fi
  for p in $DAEMONS; do
    name=${p%%:*} comm=${p#*:}
    alive "$name" "$comm" || { rm -f "$STATE/$name.pid"; continue; }
    pid=$(cat "$STATE/$name.pid")
    kill -TERM "$pid" 2>/dev/null
    wait_for 15 dead "$name" "$comm" || { kill -KILL "$pid" 2>/dev/null; wait_for 5 dead "$name" "$comm"; }
    alive "$name" "$comm" && left+=" $name($pid)" || rm -f "$STATE/$name.pid"
  done
  [[ -z $left ]] || die "still running after KILL:$left"
  [[ $quiet == quiet ]] || echo "local slurm cluster stopped"
}

status() {
  if alive slurmctld slurmctld && out=$(sinfo -h -o '%P %T %D %c' 2>&1); then
    echo "up: $out (accounting=$(cat "$STATE/mode" 2>/dev/null))"
  else
    echo "down"; return 1
  fi
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start [--accounting] | stop | status" >&2; exit 2 ;;
esac
