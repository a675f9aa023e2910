#!/usr/bin/env bash
# The project's tests, in two tiers.
#
# `scripts/test.sh --fast`: the inner loop, after each edit (under 3 minutes on 2 cores): the unit tests and the fast
# integration tests (tests/unit and tests/integration without the `slow` marker) and the control plane at full scale
# (tests/scale: a simulated SageMaker of 256 x 32 ranks on a virtual clock, about 20 s of CPU) in .venv on two pytest-xdist
# workers, nothing else (no XLA or NxD tier, no flows, chaos, deployments or README blocks). A test whose body
# takes more than about 4 s on an idle machine is marked `slow`; the fast tier fails when a test not so marked
# overruns its budget (--test-budget, HLAT_TEST_BUDGET_S, default 8 s for a test's body, 3x that for a fixture's
# set-up or teardown, times the load average per core when that is over 1: tests/conftest.py), so a new slow test
# makes the tier fail, naming it, rather than slow. Arguments after --fast go to its pytest.
#
# `scripts/test.sh`: before a commit that touches flows, jobs, the CLI or deployments, and in CI (.ci/run), after
# `scripts/install.sh dev xla xla-2.28`: the main suite (every test of tests/, slow ones included) in .venv on two
# pytest-xdist workers (HLAT_TEST_WORKERS), and beside it, for each Neuron SDK of HLAT_TEST_SDKS whose environment was installed
# (.venv-xla-2.28: 2.28.0, the default neuron.sdk; .venv-xla: 2.24.1, the last release with XLA_USE_BF16 /
# XLA_DOWNCAST_BF16), the XLA tier (tests/xla: the training loop on XLA:CPU) then the NxD tier (tests/nxd:
# tensor/sequence/pipeline parallelism on neuronx-distributed's CPU mode, that SDK's release of it).
# HLAT_TEST_SDKS: the SDKs whose tiers run, in order (default "2.28.0 2.24.1"; "2.28.0" leaves 2.24.1's tiers out,
# and the summary says so). Arguments go to the main suite's pytest (`-n 0` runs it in one process).
#
# Either fails when any test fails, when a tier collects no tests (pytest's exit code 5), and when a tier's wall time
# overruns its budget (BUDGET_S below, docs/testing.md#time-budgets), naming the tier, its time and its budget.
# HLAT_BUDGET_SCALE multiplies every budget (default 1; e.g. 2 on a machine half as fast; 0 turns the check off).
#
# Several streams share the machine's cores, so each process computes on one thread (OMP_NUM_THREADS=1): two torch
# processes with two OpenMP threads each on 2 cores run a training step ~6x slower than with one thread each, as
# their threads spin against each other. Much of the suite waits (servers starting, jobs polled, PyPI answering),
# which the other streams fill. For the same reason Inductor compiles in the process that asks
# (TORCHINDUCTOR_COMPILE_THREADS=1): a pool of compile workers, each a Python importing torch, costs more than it
# saves on a busy machine, and torch_xla starts one at import in every XLA process (tiers, NxD ranks) that never uses it.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"

# Each tier's wall-time budget in seconds, from CI's clean-clone runs on the 2-core machine with headroom for a busy
# one (docs/testing.md#time-budgets). The tiers run beside the main suite, so command 2 takes about the main suite's time.
declare -A BUDGET_S=(
  ["fast tier"]=300
  ["main suite"]=2700
  ["XLA tier (2.28.0)"]=540
  ["NxD tier (2.28.0)"]=720
  ["XLA tier (2.24.1)"]=480
  ["NxD tier (2.24.1)"]=600
)
budget_scale=${HLAT_BUDGET_SCALE:-1}
# A budget is for the whole tier: with arguments (a file, -k, -n 0), the main suite or the fast tier is timed only.
[ $# -gt 0 ] && [ "$*" != --fast ] && BUDGET_S["main suite"]=0 BUDGET_S["fast tier"]=0

# tier NAME COMMAND...: run a tier; its exit code, 1 when it collected no tests or overran its budget.
tier() {
  local name=$1 rc started=$SECONDS took budget
  shift
  "$@"
  rc=$?
  took=$((SECONDS - started))
  budget=$(awk -v b="${BUDGET_S[$name]}" -v s="$budget_scale" 'BEGIN { printf "%d", b * s }')
  echo "test.sh: the $name took $took s (budget: ${budget} s, 0 when unchecked; load average $(cut -d' ' -f1-3 /proc/loadavg))"
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: the $name collected no tests: failing" >&2
    return 1
  fi
  if [ "$budget" -gt 0 ] && [ "$took" -gt "$budget" ]; then  # 0: not checked
    echo "test.sh: OVER BUDGET: the $name took $took s, over its budget of $budget s by $((took - budget)) s:" \
      "failing (its slowest tests are in --durations above; HLAT_BUDGET_SCALE scales the budgets)" >&2
    [ "$rc" -eq 0 ] && rc=1
  fi
  return "$rc"
}

if [ "${1:-}" = --fast ]; then
  shift
  tier "fast tier" .venv/bin/python -m pytest -n 2 --dist loadfile -m "not slow" \
    --test-budget "${HLAT_TEST_BUDGET_S:-8}" --durations=10 tests/unit tests/integration tests/scale "$@"
  rc=$?
  echo "test.sh: the fast tier's exit code $rc"
  exit "$rc"
fi

# The tiers' output waits in a file and is shown after the main suite's, so the two never interleave.
# --confcutdir keeps tests/conftest.py (which needs Prefect, absent from the job image) out of every tier.
sdks=${HLAT_TEST_SDKS:-2.28.0 2.24.1}
declare -A install_target=([2.28.0]=xla-2.28 [2.24.1]=xla)  # scripts/install.sh's (core/environment.py, NEURON_SDKS)
for sdk in $sdks; do
  [ -n "${install_target[$sdk]:-}" ] || { echo "test.sh: HLAT_TEST_SDKS: unknown Neuron SDK '$sdk' (2.28.0, 2.24.1)" >&2; exit 2; }
done
tiers_log=$(mktemp -t hlat-tiers.XXXXXX)
(
  for sdk in $sdks; do
    venv=".venv-${install_target[$sdk]}"
    # An SDK's tiers run where `scripts/install.sh <target>` made its environment, and are skipped where it did not;
    # CI (HLAT_REQUIRE_XLA=1) installs both, and a missing one fails there.
    if [ ! -x "$venv/bin/python" ]; then
      if [ "${HLAT_REQUIRE_XLA:-}" = 1 ]; then
        echo "test.sh: HLAT_REQUIRE_XLA=1 but $venv is missing (scripts/install.sh ${install_target[$sdk]})" >&2
        echo "xla-$sdk=1"; echo "nxd-$sdk=1"; continue
      fi
      echo "xla-$sdk=skipped"; echo "nxd-$sdk=skipped"; continue
    fi
    tier "XLA tier ($sdk)" env HLAT_NEURON_SDK="$sdk" "$venv/bin/python" -m pytest --confcutdir=tests/xla -p no:cacheprovider --durations=5 tests/xla
    echo "xla-$sdk=$?"
    # The model-parallel path against that SDK's neuronx-distributed source (../shared/vendor) in its CPU mode
    # (HLAT_NEURON_SDK: the SDK the tier tests, tests/nxd/conftest.py; it refuses another SDK's torch-xla).
    tier "NxD tier ($sdk)" env HLAT_NEURON_SDK="$sdk" "$venv/bin/python" -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd
    echo "nxd-$sdk=$?"
  done
) >"$tiers_log" 2>&1 &
tiers=$!
trap 'rm -f "$tiers_log"' EXIT

# One test file per worker at a time (--dist loadfile), so a file's module fixtures are built once; files in
# collection order (--no-loadscope-reorder: xdist otherwise starts with the files of most tests), which
# tests/conftest.py makes longest first. Two workers (HLAT_TEST_WORKERS): three filled more of the suite's waits but
# loaded the machine to 7-10, slowed the tiers past their budgets and made a timing test fail, with no clear gain
# (39.7 and 43.6 min against 42.0 with two, docs/testing.md#time-budgets).
tier "main suite" .venv/bin/python -m pytest -n "${HLAT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=20 --cpu-durations=20 "$@"
main=$?
wait "$tiers"
echo "----- the XLA and NxD tiers of Neuron SDK ${sdks// /, }, run beside the main suite -----"
grep -v '^\(xla\|nxd\)-[0-9.]*=\([0-9]*\|skipped\)$' "$tiers_log"
failed=0
summary="main suite exit code $main"
for sdk in 2.28.0 2.24.1; do
  for tier_name in xla nxd; do
    name="$tier_name-$sdk"
    if [[ " $sdks " != *" $sdk "* ]]; then
      summary+=", $name left out (HLAT_TEST_SDKS)"
      continue
    fi
    rc=$(sed -n "s/^$name=//p" "$tiers_log")
    summary+=", $name ${rc:-not run}"
    [ "$rc" = skipped ] || [ "${rc:-1}" = 0 ] || failed=1
  done
done
echo "test.sh: $summary"
[ "$main" -eq 0 ] && [ "$failed" -eq 0 ]
