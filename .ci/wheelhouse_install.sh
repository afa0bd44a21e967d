#!/usr/bin/env bash
# `make wheelhouse` copies this into the wheelhouse as install.sh (EXTRAS filled in). On the node, no index:
#   bash wheelhouse/install.sh           install ptbench[EXTRAS] into the environment of $PYTHON (default python3)
#   bash wheelhouse/install.sh VENV      make VENV over $PYTHON, seeing its packages (its torch), install there
# A Python marked externally managed (PEP 668: Debian's and Ubuntu's system Python, many images) refuses pip
# installs into it; VENV is the way there, and without one this says so in one line. The image's torch is kept
# either way (pip: "Requirement already satisfied"). A package the wheelhouse brings because the image's version
# may not fit (setuptools<82 for torch 2.11, the image's setuptools newer) is installed in VENV over the image's
# copy, which stays as it was; without VENV pip replaces it in place. Standard library and pip: no network.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-@EXTRAS@}
venv=${1:-}

# 0: a base interpreter (not a venv) whose stdlib holds PEP 668's EXTERNALLY-MANAGED marker
externally_managed() {
    "$1" -c 'import os, sys, sysconfig
sys.exit(0 if sys.prefix == sys.base_prefix
         and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'
}

py=$PYTHON
if [ -n "$venv" ]; then
    # --without-pip: ensurepip is often absent from such images (Debian's python3-venv); the image's own pip,
    # seen through --system-site-packages, installs into the venv (a venv is never externally managed)
    "$PYTHON" -m venv --system-site-packages --without-pip "$venv"
    # a venv's system site is its base interpreter's: when PYTHON is itself a venv, add that venv's packages
    "$PYTHON" -c 'import site, sys, sysconfig
if sys.prefix != sys.base_prefix:
    dirs = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    print("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs), end="")' \
        > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_ptbench_base.pth"
    py=$venv/bin/python
elif externally_managed "$PYTHON"; then
    echo "install.sh: $PYTHON is externally managed (PEP 668), pip will not install into it: give a venv folder," \
        "bash $0 ptbench-venv (it sees $PYTHON's packages, its torch; then run ptbench-venv/bin/python -m ptbench)" >&2
    exit 2
fi
"$py" -m pip install --no-index --find-links "$here" "ptbench[$EXTRAS]"
echo "install.sh: ptbench[$EXTRAS] installed for $py; run: $py -m ptbench ..."
