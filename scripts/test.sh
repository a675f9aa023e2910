#!/usr/bin/env bash
# The README's test command, after `scripts/install.sh dev xla`: the main suite in .venv, and, at the same time in
# .venv-xla, the XLA tier (tests/xla: the training loop on XLA:CPU) then the NxD tier (tests/nxd:
# tensor/sequence/pipeline parallelism on neuronx-distributed's CPU mode). Arguments go to the main suite's pytest.
#
# The main suite runs on 2 pytest-xdist workers (HLAT_TEST_WORKERS to change; 0 runs it in one process): much of its
# time is spent waiting on Prefect servers, jobs and their processes, not computing. The tiers, computing, fill the
# rest; their output is shown when the main suite ends.
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

tiers_log=$(mktemp -t hlat-tiers-XXXXXX.log)
tiers_rc=$(mktemp -t hlat-tiers-rc-XXXXXX)
trap 'rm -f "$tiers_log" "$tiers_rc"' EXIT
(
  # --confcutdir keeps tests/conftest.py (which needs Prefect, absent from the job image) out of both tiers.
  tier "XLA tier" .venv-xla/bin/python -m pytest --confcutdir=tests/xla -p no:cacheprovider tests/xla
  xla=$?
  # The NxD tier: the model-parallel path against neuronx-distributed's source (../shared/vendor) in its CPU mode.
  tier "NxD tier" .venv-xla/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd
  echo "$xla $?" >"$tiers_rc"
) >"$tiers_log" 2>&1 &
tiers=$!

workers=${HLAT_TEST_WORKERS:-2}
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadgroup)
tier "main suite" .venv/bin/python -m pytest "${parallel[@]}" "$@"
main=$?

wait "$tiers"
echo "test.sh: the XLA and NxD tiers (run beside the main suite):"
cat "$tiers_log"
read -r xla nxd <"$tiers_rc" || { xla=1; nxd=1; }
echo "test.sh: main suite exit code $main, XLA tier exit code $xla, NxD tier exit code $nxd"
[ "$main" -eq 0 ] && [ "$xla" -eq 0 ] && [ "$nxd" -eq 0 ]
