#!/usr/bin/env bash
# `make test-repeat`: the tests that once failed at random (issue 35), each COUNT times in a row
# (50 by default) with a CPU burner beside them at niceness 0, as a busy neighbour would run.
# The first red run stops it. Extra arguments replace the list of tests.
set -euo pipefail
cd "$(dirname "$0")/.."
count=${COUNT:-50}
python=${PYTHON:-.venv/bin/python}
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(
    tests/test_http.py::test_openai_sdk_chat_completion_and_stream_on_the_chat_model
    tests/test_http.py::test_burst_of_200_mixed_requests_each_completes_or_is_refused
    tests/test_batch.py::test_one_greedy_question_gets_one_answer_whatever_the_cache_holds_and_the_rows_beside
    tests/test_policy_slots.py::test_prop_two_equal_t4_flows_get_equal_slot_seconds_within_the_slots_bound
    tests/test_policy_properties.py::test_prop_two_backlogged_equal_flows_differ_by_at_most_two_largest_jobs
    tests/test_robustness.py::test_fuzz_client_validation_accepts_only_valid_jobs
    tests/test_service.py
  )
fi
"$python" -c 'while True: pass' &
burner=$!
trap 'kill $burner 2>/dev/null || true' EXIT
for test in "${tests[@]}"; do
  started=$(date +%s)
  echo "== $test x$count, a CPU burner beside, load $(cut -d' ' -f1 /proc/loadavg)"
  if ! "$python" -m pytest -q -x -p no:cacheprovider -p no:randomly --count="$count" "$test"; then
    echo "== $test FAILED after $(( $(date +%s) - started )) s"
    exit 1
  fi
  echo "== $test green x$count in $(( $(date +%s) - started )) s"
done
echo "== every test green $count times in a row"
