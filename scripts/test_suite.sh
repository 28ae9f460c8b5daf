#!/usr/bin/env bash
# `make test`'s pytest: the suite as two shards run at once, each its own pytest session.
#
# Most of a run waits on servers starting and answering (vLLM's start-ups, the tiny model's,
# streamed answers): one pytest session kept 2 cores ~65% busy (load 1.1-1.5). Two sessions
# side by side fill them. Each shard is a whole session: its own served servers, TMPDIR and
# end-of-run check (tests/conftest.py), the second in a process group of its own, so neither
# check counts the other's processes. The first shard prints as it runs; the second's output
# follows when both are done. The exit status is 1 when either failed.
#
#   scripts/test_suite.sh [PYTEST ARGS]     e.g. -x, -k NAME, -m "not vllm", a folder
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
# (a background job of this script is no group leader: setsid gives it a session and group
# of its own without forking, so $! is pytest's pid and its group's id)
SUITE_SHARD=2/2 setsid "$py" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1 &
other=$!
trap 'kill -TERM -- "-$other" 2>/dev/null; rm -f "$log"; exit 130' INT TERM

echo "make test: shard 1/2 (tests/server) here, shard 2/2 (the other folders) beside it"
SUITE_SHARD=1/2 "$py" -m pytest -q -p no:cacheprovider "$@"
mine=$?
echo
echo "make test: waiting for shard 2/2 ..."
wait "$other"
theirs=$?
trap - INT TERM
echo "----- shard 2/2 -----"
cat "$log"
rm -f "$log"
echo "make test: shard 1/2 exit $mine, shard 2/2 exit $theirs"
# 5: pytest collected nothing (a -k or -m that only the other shard's tests match)
if [ "$mine" = 5 ] && [ "$theirs" = 5 ]; then exit 5; fi
[ "$mine" = 0 ] || [ "$mine" = 5 ] || exit 1
[ "$theirs" = 0 ] || [ "$theirs" = 5 ] || exit 1
