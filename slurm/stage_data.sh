#!/usr/bin/env bash
# Copy a dataset to node-local disk: run once per node (srun --ntasks-per-node=1), as the paper did,
# so ranks read from local disk, not the shared file system.
#   stage_data.sh SRC DEST    # copies SRC/. into DEST, or reuses a DEST this job (array) staged from SRC
#   stage_data.sh --clean DEST
#
# DEST is on a disk other users share (/tmp), and its name can be guessed from the job id, so it is used
# only if it is this user's: made here (mkdir fails on anything already there), or found as a folder
# owned by this user that no one else can write, not a link, in a parent folder where no one else can
# rename it away (every folder above DEST is root's or ours, and none is writable by others unless it
# is sticky, as /tmp is). Once checked it cannot be swapped: a check that cannot lose a race.
#
# Safe when several jobs or array tasks share a node: the check and the copy run under a lock inside
# DEST (DEST/.bench-lock, which no one else can make or hold), the copy goes to DEST/.part.XXXXXX, its
# modes made unwritable for group and others (a group dataset's files are group-writable, and a group
# member could otherwise change them under our ranks), and only when it is complete is it moved into
# place and a marker DEST/.bench-staged written, naming the source, its size and the cluster +
# (array) job that staged it. A DEST with another marker, or with files and none, is never deleted or
# overwritten: staging then fails and says so (set STAGE_DIR elsewhere or remove it). --clean removes
# DEST only if it is ours and this job staged it.
set -euo pipefail
usage="usage: stage_data.sh SRC DEST | stage_data.sh --clean DEST"
job="${SLURM_CLUSTER_NAME:-}/${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-none}}"
me=$(id -u)

# Why folder $1 is not this user's to stage into (empty when it is): ours, not a link, not writable by others.
not_ours() {
  local owner mode
  [[ -L $1 ]] && { echo "a symbolic link"; return; }
  [[ -d $1 ]] || { echo "not a folder"; return; }
  read -r owner mode < <(stat -c '%u %a' -- "$1")
  ((owner == me)) || { echo "owned by uid $owner, not by this user (uid $me)"; return; }
  ((8#$mode & 8#022)) && echo "writable by others (mode $mode)"
  return 0
}

# Why another user could swap DEST after it was checked (empty when no one can): a folder above it that is
# neither root's nor ours, or that others can write without the sticky bit.
unsafe_above() {
  local d=$1 owner mode
  while [[ $d != / ]]; do
    d=$(dirname -- "$d")
    read -r owner mode < <(stat -c '%u %a' -- "$d")
    if ((owner != 0 && owner != me)); then echo "$d is owned by uid $owner"; return; fi
    if ((8#$mode & 8#022 && !(8#$mode & 8#1000))); then echo "$d is writable by others (mode $mode)"; return; fi
  done
}

refuse() {
  echo "stage_data: not staging into $dest: $*; set STAGE_DIR=<a folder of yours on node-local disk>" >&2
  exit 1
}

if [[ ${1:-} == --clean ]]; then
  dest=${2:?$usage}
  if [[ -z $(not_ours "$dest") && -f $dest/.bench-staged ]] && grep -qxF "job=$job" "$dest/.bench-staged"; then
    rm -rf -- "$dest"
  elif [[ -n $(not_ours "$dest") && ( -e $dest || -L $dest ) ]]; then
    echo "stage_data: not removing $dest: it is $(not_ours "$dest")" >&2
  elif [[ -e $dest ]]; then
    echo "stage_data: not removing $dest: staged by another job ($(grep '^job=' "$dest/.bench-staged" 2>/dev/null || echo 'no marker'))" >&2
  fi
  exit 0
fi
src=${1:?$usage}
dest=${2:?$usage}
umask 077 # DEST, its lock and its marker are this user's alone (the copy keeps its modes, less go-w)
[[ -d $src ]] || { echo "stage_data: $src is not a directory (set DATA= at the top of the sbatch script)" >&2; exit 1; }
src=$(realpath "$src")
mkdir -p -- "$(dirname -- "$dest")"
# the parent's real path, DEST's own name kept: a link at DEST must be seen, not followed
dest=$(realpath -e -- "$(dirname -- "$dest")")/$(basename -- "$dest")
above=$(unsafe_above "$dest")
[[ -z $above ]] || refuse "$above, so another user could replace it after it is checked"
mkdir -m 700 -- "$dest" 2>/dev/null || true # ours if made here; otherwise checked next
why=$(not_ours "$dest")
[[ -z $why ]] || refuse "it is $why (another user may have made or changed it)"

exec 9>>"$dest/.bench-lock"
flock -w 3600 9 || { echo "stage_data: waited an hour for $dest/.bench-lock" >&2; exit 1; }
key=$(printf 'src=%s\nsize=%s\njob=%s' "$src" "$(du -sb "$src" | cut -f1)" "$job")
if [[ -f $dest/.bench-staged && $(cat "$dest/.bench-staged") == "$key" ]]; then
  exit 0   # staged already by an earlier task of this array on this node (it may be reading it now)
fi
shopt -s nullglob dotglob
others=()
for f in "$dest"/*; do [[ ${f##*/} == @(.bench-lock|.part.*) ]] || others+=("$f"); done
if ((${#others[@]})); then
  echo "stage_data: $dest exists but was not staged from $src by job $job (marker: $({ tr '\n' ' ' < "$dest/.bench-staged"; } 2>/dev/null || echo none)):" \
    "not touching it; remove it or set STAGE_DIR" >&2
  exit 1
fi
rm -rf -- "$dest"/.part.* # a copy cut short by an earlier attempt: never moved into place
part=$(mktemp -d "$dest/.part.XXXXXX")
trap 'rm -rf -- "$part"' EXIT
cp -a "$src"/. "$part"/
chmod -R go-w -- "$part"
for f in "$part"/*; do mv -T -- "$f" "$dest/${f##*/}"; done
rmdir -- "$part"
trap - EXIT
printf '%s\n' "$key" > "$dest/.part.marker"
mv -T -- "$dest/.part.marker" "$dest/.bench-staged" # last: the copy is complete when it is marked
echo "staged $src -> $(hostname -s):$dest ($(du -sh "$dest" | cut -f1))"
