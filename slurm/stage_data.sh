#!/usr/bin/env bash
# Copy a dataset to node-local disk: run once per node (srun --ntasks-per-node=1), as the paper did,
# so ranks read from local disk, not the shared file system.
#   stage_data.sh SRC DEST    # copies SRC/. into DEST, or reuses a DEST this job (array) staged from SRC
#   stage_data.sh --clean DEST
#
# Safe when several jobs or array tasks share a node: the check and the copy run under a lock
# (DEST.lock), the copy goes to a private DEST.part.XXXXXX and is renamed to DEST when complete, and
# a marker DEST/.bench-staged names the source, its size and the cluster + (array) job that staged
# it. A DEST with another marker or none is never deleted or overwritten: staging then fails and says
# so (set STAGE_DIR elsewhere or remove it). --clean removes DEST only if this job staged it.
set -euo pipefail
usage="usage: stage_data.sh SRC DEST | stage_data.sh --clean DEST"
job="${SLURM_CLUSTER_NAME:-}/${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-none}}"

if [[ ${1:-} == --clean ]]; then
  dest=${2:?$usage}
  if [[ -f $dest/.bench-staged ]] && grep -qxF "job=$job" "$dest/.bench-staged"; then
    rm -rf -- "$dest" "$dest.lock"
  elif [[ -e $dest ]]; then
    echo "stage_data: not removing $dest: staged by another job ($(grep '^job=' "$dest/.bench-staged" 2>/dev/null || echo 'no marker'))" >&2
  fi
  exit 0
fi
src=${1:?$usage}
dest=${2:?$usage}
[[ -d $src ]] || { echo "stage_data: $src is not a directory (set DATA= at the top of the sbatch script)" >&2; exit 1; }
src=$(realpath "$src")
mkdir -p "$(dirname "$dest")"

exec 9>>"$dest.lock"
flock -w 3600 9 || { echo "stage_data: waited an hour for $dest.lock" >&2; exit 1; }
key=$(printf 'src=%s\nsize=%s\njob=%s' "$src" "$(du -sb "$src" | cut -f1)" "$job")
if [[ -f $dest/.bench-staged && $(cat "$dest/.bench-staged") == "$key" ]]; then
  exit 0   # staged already by an earlier task of this array on this node (it may be reading it now)
fi
if [[ -e $dest ]]; then
  echo "stage_data: $dest exists but was not staged from $src by job $job (marker: $(tr '\n' ' ' < "$dest/.bench-staged" 2>/dev/null || echo none)):" \
    "not touching it; remove it or set STAGE_DIR" >&2
  exit 1
fi
part=$(mktemp -d "$dest.part.XXXXXX")
trap 'rm -rf -- "$part"' EXIT
cp -a "$src"/. "$part"/
printf '%s\n' "$key" > "$part/.bench-staged"
chmod 755 "$part"   # mktemp -d makes it 700
mv -T -- "$part" "$dest"   # a rename: appears whole or not at all
trap - EXIT
echo "staged $src -> $(hostname -s):$dest ($(du -sh "$dest" | cut -f1))"
