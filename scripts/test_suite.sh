#!/usr/bin/env bash
# `make test`'s pytest: the suite as two shards run at once, each its own pytest session.
#
# Most of a run waits on servers starting and answering (vLLM's start-ups, the tiny model's,
# streamed answers): one pytest session kept 2 cores ~65% busy (load 1.1-1.5). Two sessions
# side by side fill them. Each shard is a whole session: its own served servers, TMPDIR and
# end-of-run check (tests/conftest.py), each in a process group of its own, so neither check
# counts the other's processes. The first shard prints as it runs; the second's output
# follows when both are done. The exit status is 1 when either failed (5 when neither
# collected a test). -x stops the shard whose test failed; the other runs to its end.
# Ctrl-C (or TERM, HUP) reaches both shards as an interrupt: each stops its servers and
# reports, then the script exits 130 (143 for TERM, 129 for HUP).
#
#   scripts/test_suite.sh [PYTEST ARGS]   e.g. -x, -k NAME, -m "not vllm", a folder
#   SUITE_SHARDS=1 scripts/test_suite.sh  one session, as before (a quiet machine to
#                                         time tests on, or a bisection)
set -u
cd "$(dirname "$0")/.."
py=.venv/bin/python

if [ "${SUITE_SHARDS:-2}" = 1 ]; then
  exec "$py" -m pytest -q -p no:cacheprovider "$@"
fi

# The shards (tests/conftest.py, SUITE_SHARD): tests/server and tests/media in the first,
# the other folders in the second, a served server's tests all where most of them are (two
# at once took 20 and 22.5 minutes on 2 cores, where one session took 36.5; 2026-12-07).
log=$(mktemp "${TMPDIR:-/tmp}/aphrodite-second-shard-XXXXXX")
pids=()
stopped=0
interrupt() {  # forward the signal as an interrupt (pytest's KeyboardInterrupt: it tears down)
  stopped=$1
  kill -INT "${pids[@]}" 2>/dev/null
}
trap 'interrupt 130' INT
trap 'interrupt 143' TERM
trap 'interrupt 129' HUP
# Job control: each shard in a process group of its own (what its end-of-run check counts),
# neither ignoring SIGINT as a plain background job would; the script waits on both, so a
# signal is forwarded at once.
set -m
echo "make test: shard 1/2 (tests/server, tests/media) here, shard 2/2 (the other folders)" \
     "beside it"
# pytest with Python's own SIGINT handler even where this script started with SIGINT ignored
# (a background job of a shell without job control): the interrupt always reaches it
pytest=("$py" -c "import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main())" -q -p no:cacheprovider)
SUITE_SHARD=1/2 "${pytest[@]}" "$@" &
pids+=($!)
SUITE_SHARD=2/2 "${pytest[@]}" "$@" >"$log" 2>&1 &
pids+=($!)
codes=()
for pid in "${pids[@]}"; do
  while :; do  # (a trapped signal ends wait early: wait again for the same shard)
    wait "$pid"
    code=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  codes+=("$code")
done
set +m
echo
echo "----- shard 2/2 -----"
cat "$log"
rm -f "$log"
echo "make test: shard 1/2 exit ${codes[0]}, shard 2/2 exit ${codes[1]}"
[ "$stopped" = 0 ] || exit "$stopped"
# 5: pytest collected nothing (a -k or -m that only the other shard's tests match)
if [ "${codes[0]}" = 5 ] && [ "${codes[1]}" = 5 ]; then exit 5; fi
for code in "${codes[@]}"; do
  [ "$code" = 0 ] || [ "$code" = 5 ] || exit 1
done
