#!/usr/bin/env bash
# The README's test command, after `scripts/install.sh dev xla`: the main suite in .venv, then the XLA tier
# (tests/xla: the training loop on XLA:CPU) in .venv-xla. Arguments go to the main suite's pytest.
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
echo "test.sh: main suite exit code $main, XLA tier exit code $xla"
[ "$main" -eq 0 ] && [ "$xla" -eq 0 ]
