#!/usr/bin/env bash
# Create the project's environments with the pins that work together.
# Usage: scripts/install.sh              .venv: the pipeline
#        scripts/install.sh dev          .venv: the pipeline and the test/lint tools
#        scripts/install.sh xla          .venv-xla: the default Neuron image's torch and torch-xla, run on the CPU
#        scripts/install.sh dev xla      both
#
# .venv: torch goes first: `torch==2.13.0` is the local CPU build; anything resolving torch later would pull GBs
# of CUDA. Then the project under constraints.txt.
# .venv-xla: the training jobs' side of the trn1 image (deployments/neuron-image-2.24.1.txt: torch 2.7, torch-xla
# 2.7, numpy, protobuf, tensorboard as the image pins them) plus what a job installs on it
# (deployments/job-requirements.txt) and pytest. The job programs run there on XLA:CPU (PJRT_DEVICE=CPU) when
# training.device=xla: the local rehearsal of the trn1 code path. PyPI's torch 2.7.0 is its CUDA build (~3 GB
# download, 5.7 GB installed); it runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
main=0 dev=0 xla=0
[ $# -eq 0 ] && main=1
for target in "$@"; do
  case "$target" in
    dev) main=1 dev=1 ;;
    xla) xla=1 ;;
    *) echo "install.sh: unknown target '$target' (choose: dev, xla)" >&2; exit 2 ;;
  esac
done
quiet=(--quiet --disable-pip-version-check)

if [ "$main" = 1 ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  pip=(.venv/bin/python -m pip install "${quiet[@]}")
  "${pip[@]}" torch==2.13.0
  extras=""; [ "$dev" = 1 ] && extras="[dev]"
  "${pip[@]}" -c constraints.txt -e ".$extras"
fi

if [ "$xla" = 1 ]; then
  [ -x .venv-xla/bin/python ] || python3 -m venv .venv-xla
  image=deployments/neuron-image-2.24.1.txt
  pins=$(grep -E '^(pytest|safetensors|tenacity)==' constraints.txt | tr '\n' ' ')
  # Everything the image pins that a job program imports, as the image has it; the job's own installs; what the
  # image's neuronx-distributed needs besides torch-xla (safetensors, tenacity: tests/nxd runs NxD's source); pytest.
  # shellcheck disable=SC2086
  .venv-xla/bin/python -m pip install "${quiet[@]}" -c "$image" \
    torch torch-xla numpy protobuf tensorboard -r deployments/job-requirements.txt $pins
fi

# The browser test drives Debian's Chromium (not a Playwright download): install it where we may.
if [ "$dev" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    as_root=(); [ "$(id -u)" = 0 ] || as_root=(sudo -n)
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "install.sh: chromium not found and apt-get not usable: the browser test (tests/e2e) will be skipped" >&2
  fi
fi
