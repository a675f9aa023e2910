#!/usr/bin/env bash
# Create ./.venv and install hlat with the pins that work together (constraints.txt).
# torch goes first: `torch==2.13.0` is the local CPU build; anything resolving torch later would pull GBs of CUDA.
# Usage: scripts/install.sh            the pipeline
#        scripts/install.sh dev        the pipeline and the test/lint tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -c constraints.txt -e ".${extras:+[$extras]}"
