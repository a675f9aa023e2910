#!/usr/bin/env bash
# The README's test command, after `scripts/install.sh dev xla`: the main suite in .venv, then in .venv-xla the XLA
# tier (tests/xla: the training loop on XLA:CPU) and the NxD tier (tests/nxd: tensor/sequence/pipeline parallelism
# on neuronx-distributed's CPU mode). Arguments go to the main suite's pytest.
# Fails when any test fails, and when a tier collects no tests (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."

tier() {
  local name=$1 rc
  shift
  "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: the $name collected no tests: failing" >&2
    return 1
  fi
  return "$rc"
}

tier "main suite" .venv/bin/python -m pytest "$@"
main=$?
# --confcutdir keeps tests/conftest.py (which needs Prefect, absent from the job image) out of the XLA tier.
tier "XLA tier" .venv-xla/bin/python -m pytest --confcutdir=tests/xla -p no:cacheprovider tests/xla
xla=$?
# The NxD tier: the model-parallel path against neuronx-distributed's source (../shared/vendor) in its CPU mode.
tier "NxD tier" .venv-xla/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd
nxd=$?
echo "test.sh: main suite exit code $main, XLA tier exit code $xla, NxD tier exit code $nxd"
[ "$main" -eq 0 ] && [ "$xla" -eq 0 ] && [ "$nxd" -eq 0 ]
