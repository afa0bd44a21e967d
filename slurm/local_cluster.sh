#!/usr/bin/env bash
# Start/stop a real Slurm cluster (Debian 12, Slurm 22.05) on this machine as root, without systemd.
#   bash slurm/local_cluster.sh start [--accounting]   # one node; idempotent; --accounting adds MariaDB + slurmdbd
#   bash slurm/local_cluster.sh stop | status
#   bash slurm/local_cluster.sh start --nodes 2        # N nodes, one slurmd per network namespace (below)
#   bash slurm/local_cluster.sh stop --nodes 2 | status --nodes 2
# Env: SLURM_LOCAL_CPUS (per node; default the machine's cores, nproc: more lets jobs share cores),
#      SLURM_LOCAL_MEM (MB, 8000, per node), SLURM_LOCAL_TIMEOUT (s, 90),
#      SLURM_LOCAL_STATE (PID/log dir, /var/run/trainbench-slurm), SLURM_LOCAL_PARTITION (debug),
#      SLURM_LOCAL_MULTI (everything of the --nodes N>1 cluster, /var/run/trainbench-slurm-multi),
#      SLURM_LOCAL_CRED_EXPIRE (s, 10: Slurm's cred_expire, which also holds a requeued job back; Slurm's default 120).
#
# --nodes N (N >= 2): nodes tbn1..tbnN, each a slurmd in its own network namespace (tbnI, veth tbvI
# <-> eth0 10.231.0.(10+I)/24 on the bridge tbbr0 = 10.231.0.1) and UTS namespace (host name tbnI);
# slurmctld and a private munged in the root namespace. Its slurm.conf, state, spool, logs and munge
# socket live under SLURM_LOCAL_MULTI, with ports 6917/6918, so /etc/slurm and the one-node cluster
# (which may run at the same time) are untouched. Use it with `export SLURM_CONF=$SLURM_LOCAL_MULTI/etc/slurm.conf`.
set -uo pipefail

CPUS=${SLURM_LOCAL_CPUS:-$(nproc --all)}   # the cores there are (plain nproc obeys a caller's OMP_NUM_THREADS=1)
MEM=${SLURM_LOCAL_MEM:-8000}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-90}
STATE=${SLURM_LOCAL_STATE:-/var/run/trainbench-slurm}
PART=${SLURM_LOCAL_PARTITION:-debug}
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-10}   # s; a requeued job waits this long before it may start again
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

conf_text() {  # conf_text ACCOUNTING(0|1): the slurm.conf of the one-node cluster
  local acct="accounting_storage/none" gather="jobacct_gather/none"
  if (($1)); then acct="accounting_storage/slurmdbd"; gather="jobacct_gather/linux"; fi
  cat <<EOF
$MARK
ClusterName=trainbench
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# cred_expire also holds a requeued job (scontrol requeue) back that long: Slurm's default is 120 s
AuthInfo=cred_expire=$CRED_EXPIRE
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
# config_overrides: trust CPUs= below as given (no drain when SLURM_LOCAL_CPUS says more than the box has;
# the default is its nproc --all, so that jobs never share cores and their timings compare).
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
AccountingStorageType=$acct
AccountingStorageHost=localhost
JobAcctGatherType=$gather
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

write_conf() {  # write_conf ACCOUNTING(0|1)
  local f=/etc/slurm/slurm.conf
  # Never silently clobber a slurm.conf someone else wrote.
  [[ -f $f ]] && ! grep -qF "$MARK" "$f" && cp -n "$f" "$f.orig"
  conf_text "$1" > "$f"
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
# start begins with an empty queue: slurmctld restores the jobs of its saved state (a machine stopped
# mid-job, e.g. a container snapshot), requeues the lost ones and would start them again on the fresh
# node (seen in CI: "node not idle: mixed"). Nothing of them is alive any more (stop ran): cancel them.
forget_jobs() {
  local left; left=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  [[ -z $left ]] && return 0
  echo "local_cluster: cancelling jobs restored from saved state: $left" >&2
  xargs -r scancel <<< "$left" 2>/dev/null   # a restored running one completes once its slurmd registers
}
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
  # (up with a slurm.conf other than the one this script writes now, e.g. an older version's: restart)
  local mode; mode=$(cat "$STATE/mode" 2>/dev/null || echo -1)
  if alive slurmctld slurmctld && alive slurmd slurmd && ((mode >= acct)) && node_up \
      && [[ $(conf_text "$mode") == "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]]; then
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
  forget_jobs
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

# ---- N nodes on this machine: one slurmd per network + UTS namespace ------------------------------
# Only names with these prefixes are ever created or deleted: namespaces tbnI, veths tbvI, the bridge
# tbbr0, /etc/hosts lines ending in $MULTI_MARK, cgroup dirs slurm_tbnI.
MULTI=${SLURM_LOCAL_MULTI:-/var/run/trainbench-slurm-multi}
BRIDGE=tbbr0
NET=10.231.0          # private /24: the bridge is .1, node I is .(10+I)
MULTI_MARK="# trainbench-multi"
CTLD_PORT=6917 SLURMD_PORT=6918   # the one-node cluster uses Slurm's defaults 6817/6818

multi_nodes() {  # the node names recorded by the last start, else leftovers found in the system
  if [[ -s $MULTI/nodes ]]; then cat "$MULTI/nodes"; return; fi
  { ip netns list 2>/dev/null | awk '{print $1}'
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//; s/^tbv/tbn/'
    grep "$MULTI_MARK\$" /etc/hosts 2>/dev/null | awk '{print $2}'; } | grep -xE 'tbn[0-9]+' | sort -u
}

multi_conf() {  # multi_conf NODE... : slurm.conf + cgroup.conf under $MULTI/etc
  local n i nodelines=""
  for n in "$@"; do
    i=${n#tbn}
    nodelines+="NodeName=$n NodeAddr=$NET.$((10 + i)) NodeHostname=$n CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"$'\n'
  done
  cat > "$MULTI/etc/slurm.conf" <<EOF
$MARK (--nodes $#)
ClusterName=trainbench-multi
SlurmctldHost=$HOST($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# a private munged: the one-node cluster's munged may come and go independently
AuthInfo=socket=$MULTI/munge/munge.socket,cred_expire=$CRED_EXPIRE
StateSaveLocation=$MULTI/ctld
SlurmdSpoolDir=$MULTI/spool/%n
SlurmctldLogFile=$MULTI/log/slurmctld.log
SlurmdLogFile=$MULTI/log/slurmd-%n.log
SlurmctldPidFile=$MULTI/run/slurmctld.pid
SlurmdPidFile=$MULTI/run/slurmd-%n.pid
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
${nodelines}PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  printf '%s\nCgroupPlugin=autodetect\nCgroupMountpoint=/sys/fs/cgroup\n' "$MARK" > "$MULTI/etc/cgroup.conf"
}

multi_net_up() {  # multi_net_up NODE...
  local n i
  ip link add "$BRIDGE" type bridge && ip addr add "$NET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up \
    || die "cannot create bridge $BRIDGE ($NET.1/24)"
  for n in "$@"; do
    i=${n#tbn}
    ip netns add "$n" && ip link add "tbv$i" type veth peer name eth0 netns "$n" \
      && ip link set "tbv$i" master "$BRIDGE" up \
      && nsenter --net="/var/run/netns/$n" sh -c "ip addr add $NET.$((10 + i))/24 dev eth0 && ip link set eth0 up && ip link set lo up" \
      || die "cannot create network namespace $n"
    echo "$NET.$((10 + i)) $n $MULTI_MARK" >> /etc/hosts
  done
}

gone_link() { ! ip link show "$1" >/dev/null 2>&1; }

multi_net_down() {  # multi_net_down NODE... : removes only what multi_net_up creates
  local n i d kept
  for n in "$@"; do
    i=${n#tbn}
    # the veth first: deleting a namespace frees its end of the pair only later (asynchronously)
    ip link del "tbv$i" 2>/dev/null; wait_for 5 gone_link "tbv$i"
    ip netns del "$n" 2>/dev/null
    # per-node cgroup dirs (proctrack/cgroup with several slurmd on one host: slurm_<node>)
    for d in /sys/fs/cgroup/*/"slurm_$n" /sys/fs/cgroup/"slurm_$n"; do
      [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
  done
  ip link del "$BRIDGE" 2>/dev/null; wait_for 5 gone_link "$BRIDGE"
  if grep -q "$MULTI_MARK\$" /etc/hosts; then
    # rewrite in place (keeps the inode: /etc/hosts may be a bind mount)
    kept=$(grep -v "$MULTI_MARK\$" /etc/hosts); printf '%s\n' "$kept" > /etc/hosts
  fi
}

nodes_idle() {  # every node idle; resumes a drained one (a DRAIN saved in the state survives restarts)
  local out; out=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  [[ -n $out ]] || return 1
  awk '$2 ~ /^drain/ {print $1}' <<< "$out" | xargs -r -I{} scontrol update NodeName={} State=RESUME 2>/dev/null
  awk '$2 != "idle" {bad = 1} END {exit bad}' <<< "$out"
}

multi_start() {  # multi_start N
  local n=$1 t0=$SECONDS node nodes=() i
  ((n >= 2 && n <= 200)) || die "--nodes must be 1..200"
  [[ $(id -u) == 0 ]] || die "must run as root"
  [[ $CPUS =~ ^[1-9][0-9]*$ && $MEM =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS/SLURM_LOCAL_MEM must be positive integers"
  for ((i = 1; i <= n; i++)); do nodes+=("tbn$i"); done
  # idempotent-ish: always begin from nothing (leftovers of a crashed start included)
  multi_stop quiet || exit 1
  mkdir -p "$MULTI"/{etc,ctld,spool,log,run,munge} || die "cannot create $MULTI"
  trap 'multi_stop quiet >/dev/null 2>&1' EXIT
  install_pkgs slurmctld slurmd slurm-client munge
  printf '%s\n' "${nodes[@]}" > "$MULTI/nodes"
  multi_net_up "${nodes[@]}"
  # slurmctld's host name must resolve (a marked line: stop removes it again)
  getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST $MULTI_MARK" >> /etc/hosts
  multi_conf "${nodes[@]}"
  export SLURM_CONF=$MULTI/etc/slurm.conf

  # a private munged (same key as the system's, created if absent), its socket under $MULTI/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge && dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none || die "cannot write munge key"
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  chown munge:munge "$MULTI/munge" && chmod 755 "$MULTI/munge"   # clients need x on the socket dir
  install -o munge -g munge -m 400 /etc/munge/munge.key "$MULTI/munge/munge.key" || die "cannot copy the munge key"
  launch munge setpriv --reuid=munge --regid=munge --init-groups munged -F --socket="$MULTI/munge/munge.socket" \
    --key-file="$MULTI/munge/munge.key" --pid-file="$MULTI/munge/munged.pid" --log-file="$MULTI/munge/munged.log" \
    --seed-file="$MULTI/munge/munged.seed"
  wait_for 10 munge -n -S "$MULTI/munge/munge.socket" || die "munged did not come up (see $MULTI/munge.out, $MULTI/munge/munged.log)"

  launch slurmctld slurmctld -D -i
  wait_for 20 scontrol ping || die "slurmctld did not come up (see $MULTI/slurmctld.out, $MULTI/log/slurmctld.log)"
  forget_jobs
  for node in "${nodes[@]}"; do
    # nsenter --net, not `ip netns exec` (that remounts /sys: slurmd then finds no cgroups);
    # unshare --uts: an own host name, which gloo resolves to the node's address, not 127.0.0.1
    launch "slurmd-$node" nsenter --net="/var/run/netns/$node" unshare --uts \
      sh -c "hostname $node && exec slurmd -D -N $node"
  done
  wait_for "$TIMEOUT" nodes_idle \
    || die "nodes not idle after ${TIMEOUT}s: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ';') (see $MULTI/log/)"
  trap - EXIT
  echo "local slurm cluster up in $((SECONDS - t0))s: nodes ${nodes[*]} ($NET.11-$NET.$((10 + n)), CPUs=$CPUS each), partition $PART"
  echo "use it with: export SLURM_CONF=$SLURM_CONF   (then: sinfo -N; srun -N$n hostname; sbatch --nodes=$n ...)"
}

multi_stop() {  # removes whatever the last start created, whatever its node count
  local quiet=${1:-} nodes p name comm pid left=""
  mapfile -t nodes < <(multi_nodes)
  STATE=$MULTI
  export SLURM_CONF=$MULTI/etc/slurm.conf
  if alive slurmctld slurmctld; then
    squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null
    wait_for 15 no_jobs
  fi
  for p in "${nodes[@]/#/slurmd-}" slurmctld munge; do
    [[ -n $p ]] || continue
    name=$p comm=${p%%-*}
    [[ $comm == munge ]] && comm=munged
    alive "$name" "$comm" || { rm -f "$STATE/$name.pid"; continue; }
    pid=$(cat "$STATE/$name.pid")
    kill -TERM "$pid" 2>/dev/null
    wait_for 15 dead "$name" "$comm" || { kill -KILL "$pid" 2>/dev/null; wait_for 5 dead "$name" "$comm"; }
    alive "$name" "$comm" && left+=" $name($pid)" || rm -f "$STATE/$name.pid"
  done
  [[ -z $left ]] || die "still running after KILL:$left"
  multi_net_down "${nodes[@]}"
  rm -f "$MULTI/nodes"
  [[ $quiet == quiet ]] || echo "local slurm cluster stopped (${#nodes[@]} nodes${nodes:+: ${nodes[*]}})"
}

multi_status() {
  STATE=$MULTI
  export SLURM_CONF=$MULTI/etc/slurm.conf
  if alive slurmctld slurmctld && out=$(sinfo -N 2>&1); then
    echo "up: export SLURM_CONF=$SLURM_CONF"; echo "$out"
  else
    echo "down"; return 1
  fi
}

cmd=${1:-}
shift
nodes=1 args=()
while (($#)); do
  case $1 in
    --nodes) nodes=${2:-}; shift $(($# > 1 ? 2 : 1)) ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes needs a positive number"
if ((nodes > 1)); then
  ((${#args[@]} == 0)) || die "unknown option '${args[0]}' with --nodes $nodes (--accounting is for the one-node cluster only)"
  case $cmd in
    start) multi_start "$nodes" ;;
    stop) multi_stop ;;
    status) multi_status ;;
    *) echo "usage: $0 start|stop|status --nodes N" >&2; exit 2 ;;
  esac
  exit
fi
set -- "$cmd" "${args[@]}"

# A SLURM_CONF left exported from the --nodes recipe sends every Slurm command of the one-node cluster to
# the other one (start then failed after 31 s with "slurmdbd did not come up"): refuse at once, with the fix.
if [[ -n ${SLURM_CONF:-} && $SLURM_CONF != /etc/slurm/slurm.conf ]]; then
  die "SLURM_CONF=$SLURM_CONF is exported (the --nodes cluster's), but the one-node cluster uses /etc/slurm/slurm.conf: run 'unset SLURM_CONF' and try again"
fi

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start [--accounting] | stop | status   (or start|stop|status --nodes N)" >&2; exit 2 ;;
esac
