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

# The browser test drives Debian's Chromium (not a Playwright download): install it where we may.
if [ "$extras" = "dev" ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    as_root=(); [ "$(id -u)" = 0 ] || as_root=(sudo -n)
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "install.sh: chromium not found and apt-get not usable: the browser test (tests/e2e) will be skipped" >&2
  fi
fi
