#!/usr/bin/env bash
# Create the project's environments with the pins that work together.
# Usage: scripts/install.sh              .venv: the pipeline
#        scripts/install.sh dev          .venv: the pipeline and the test/lint tools
#        scripts/install.sh xla-2.28     .venv-xla-2.28: Neuron SDK 2.28's torch and torch-xla (the default
#                                        neuron.sdk), run on the CPU
#        scripts/install.sh xla          .venv-xla: Neuron SDK 2.24.1's (neuron.sdk=2.24.1: the last release with
#                                        XLA_USE_BF16 / XLA_DOWNCAST_BF16), run on the CPU
#        scripts/install.sh dev xla xla-2.28
#                                        the pipeline, the tools and both XLA environments (what CI uses)
#
# .venv: torch goes first: `torch==2.13.0` is the local CPU build; anything resolving torch later would pull GBs
# of CUDA. Then the project under constraints.txt.
# .venv-xla, .venv-xla-2.28: the training jobs' side of a Neuron SDK's trn1 image (deployments/neuron-image-<SDK>.txt:
# torch, torch-xla, numpy, protobuf, tensorboard as the image pins them) plus what a job installs on it
# (deployments/job-requirements-<SDK>.txt) and pytest. The job programs run there on XLA:CPU (PJRT_DEVICE=CPU) when
# training.device=xla: the local rehearsal of the trn1 code path, in this machine's Python (the images have 3.10
# and 3.12). PyPI's torch 2.7.0 and 2.9.0 are CUDA builds (~3 GB download, 5-6 GB installed each); they run on
# the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
main=0 dev=0 xla_envs=()
[ $# -eq 0 ] && main=1
for target in "$@"; do
  case "$target" in
    dev) main=1 dev=1 ;;
    xla) xla_envs+=("xla 2.24.1") ;;          # target and Neuron SDK: core/environment.py, NEURON_SDKS
    xla-2.28) xla_envs+=("xla-2.28 2.28.0") ;;
    *) echo "install.sh: unknown target '$target' (choose: dev, xla, xla-2.28)" >&2; exit 2 ;;
  esac
done
quiet=(--quiet --disable-pip-version-check)

main_environment() {
  [ -x .venv/bin/python ] || python3 -m venv .venv
  local pip=(.venv/bin/python -m pip install "${quiet[@]}")
  # pip itself first, as constraints.txt pins it: the venv's bundled pip (23.2 with Python 3.11), resolving for an
  # image's Python and platform (tests/integration/test_job_requirements.py), took twice the CPU and releases whose
  # Requires-Python, unstated by the index that offered them, excludes that Python.
  "${pip[@]}" -c constraints.txt pip
  "${pip[@]}" torch==2.13.0
  local extras=""
  [ "$dev" = 1 ] && extras="[dev]"
  "${pip[@]}" -c constraints.txt -e ".$extras"
}

# One Neuron SDK's local XLA environment, .venv-<target> (core/environment.py: NeuronSdk.local_python), and its pins.
xla_environment() {
  local venv=".venv-$1" sdk=$2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  local pins
  pins=$(grep -E '^(pytest|safetensors|tenacity)==' constraints.txt | tr '\n' ' ')
  # Everything the image pins that a job program or neuronx-distributed imports (boto3: NxD 0.17's checkpoint
  # storage), as the image has it; the job's own installs; what the
  # image's neuronx-distributed needs besides torch-xla (safetensors, tenacity: tests/nxd runs NxD's source); pytest.
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install "${quiet[@]}" -c "deployments/neuron-image-$sdk.txt" \
    torch torch-xla numpy protobuf tensorboard boto3 -r "deployments/job-requirements-$sdk.txt" $pins
}
# The environments are independent folders: they install at the same time (mostly downloads and unpacking), and
# the script fails if any of them failed.
pids=()
if [ "$main" = 1 ]; then
  main_environment &
  pids+=($!)
fi
for env in ${xla_envs[@]+"${xla_envs[@]}"}; do
  # shellcheck disable=SC2086  (target and SDK, split)
  xla_environment $env &
  pids+=($!)
done
failed=0
for pid in ${pids[@]+"${pids[@]}"}; do
  wait "$pid" || failed=1
done
if [ "$failed" = 1 ]; then
  echo "install.sh: an environment failed to install (its pip output is above)" >&2
  exit 1
fi
# The project itself, editable and without its dependencies, into each XLA environment: `import hlat.training` there
# (the tiers, the local XLA jobs, the NxD ranks) finds the layers through pyproject's package-dir mapping, as in .venv.
# One after another, and after .venv's: each build writes the project's hlat.egg-info.
for env in ${xla_envs[@]+"${xla_envs[@]}"}; do
  venv=".venv-${env%% *}"
  "$venv/bin/python" -m pip install "${quiet[@]}" --no-deps -e .
done

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
