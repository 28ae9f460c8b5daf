#!/usr/bin/env bash
# `make fuzz`: the property tests with fresh random seeds, over and over, for FUZZ_SECONDS
# (default 300). The test suite draws the same examples every run (a derandomized profile, see
# tests/conftest.py); this is where new ones are found. On the first failure it stops and
# prints the falsifying example: pin it with @example(...) on the test, then fix the code.
set -euo pipefail
cd "$(dirname "$0")/.."
budget="${FUZZ_SECONDS:-300}"
tests=(tests/engine/test_properties.py tests/unit/test_policy.py tests/unit/test_addresses.py)
deadline=$(( $(date +%s) + budget ))
runs=0
while (( $(date +%s) < deadline )); do
  seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  runs=$((runs + 1))
  if ! HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest -q -p no:cacheprovider \
      --hypothesis-seed="$seed" "${tests[@]}"; then
    echo "fuzz: run $runs (seed $seed) found a failure; reproduce with" >&2
    echo "  HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest --hypothesis-seed=$seed ${tests[*]}" >&2
    exit 1
  fi
done
echo "fuzz: $runs runs with fresh seeds in ${budget} s, no failure"
