#!/usr/bin/env bash
# The README's test command, after `scripts/install.sh dev xla`: the main suite in .venv on two pytest-xdist
# workers, and beside it, in .venv-xla, the XLA tier (tests/xla: the training loop on XLA:CPU) then the NxD tier
# (tests/nxd: tensor/sequence/pipeline parallelism on neuronx-distributed's CPU mode). Arguments go to the main
# suite's pytest (`-n 0` runs it in one process). Fails when any test fails, and when a tier collects no tests
# (pytest's exit code 5).
#
# Three streams share the machine's cores, so each process computes on one thread (OMP_NUM_THREADS=1): two torch
# processes with two OpenMP threads each on 2 cores run a training step ~6x slower than with one thread each, as
# their threads spin against each other. Much of the suite waits (servers starting, jobs polled, PyPI answering),
# which the other streams fill.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

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

# The tiers' output waits in a file and is shown after the main suite's, so the two never interleave.
# --confcutdir keeps tests/conftest.py (which needs Prefect, absent from the job image) out of both tiers.
tiers_log=$(mktemp -t hlat-tiers.XXXXXX)
(
  tier "XLA tier" .venv-xla/bin/python -m pytest --confcutdir=tests/xla -p no:cacheprovider tests/xla
  echo "xla=$?"
  # The model-parallel path against neuronx-distributed's source (../shared/vendor) in its CPU mode.
  tier "NxD tier" .venv-xla/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd
  echo "nxd=$?"
) >"$tiers_log" 2>&1 &
tiers=$!
trap 'rm -f "$tiers_log"' EXIT

# One test file per worker at a time (--dist loadfile), so a file's module fixtures are built once; files in
# collection order (--no-loadscope-reorder: xdist otherwise starts with the files of most tests), which
# tests/conftest.py makes longest first.
tier "main suite" .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
main=$?
wait "$tiers"
echo "----- the XLA and NxD tiers (.venv-xla), run beside the main suite -----"
grep -v '^\(xla\|nxd\)=[0-9]*$' "$tiers_log"
xla=$(sed -n 's/^xla=//p' "$tiers_log")
nxd=$(sed -n 's/^nxd=//p' "$tiers_log")
echo "test.sh: main suite exit code $main, XLA tier exit code ${xla:-none}, NxD tier exit code ${nxd:-none}"
[ "$main" -eq 0 ] && [ "${xla:-1}" -eq 0 ] && [ "${nxd:-1}" -eq 0 ]
