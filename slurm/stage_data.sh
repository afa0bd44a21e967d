#!/usr/bin/env bash
# Copy a dataset to node-local disk: run once per node (srun --ntasks-per-node=1), as the paper did,
# so ranks read from local disk, not the shared file system.
#   stage_data.sh SRC DEST    # copies SRC/. into DEST; a DEST that already matches SRC's size is kept
#   stage_data.sh --clean DEST
set -euo pipefail
if [[ ${1:-} == --clean ]]; then rm -rf -- "$2"; exit 0; fi
src=${1:?usage: stage_data.sh SRC DEST}
dest=${2:?usage: stage_data.sh SRC DEST}
[[ -d $src ]] || { echo "stage_data: $src is not a directory (set DATA= at the top of the sbatch script)" >&2; exit 1; }
# A previous job step on this node may already have staged it (e.g. array tasks sharing a node).
if [[ -d $dest && $(du -sb "$src" | cut -f1) == $(du -sb "$dest" | cut -f1) ]]; then exit 0; fi
mkdir -p "$dest.part.$$"
cp -a "$src"/. "$dest.part.$$"/
rm -rf -- "$dest" && mv "$dest.part.$$" "$dest"   # appears whole or not at all
echo "staged $src -> $(hostname -s):$dest ($(du -sh "$dest" | cut -f1))"
