#!/usr/bin/env bash
# The measurement behind `serve --data-parallel-size auto` and the thread defaults
# (engine/cpus.py auto_parallel): per model size, `aphrodite serve` started with each engine
# setting in turn, the same load from `aphrodite bench serve` against each, repeats
# interleaved (size by size: A, B, C, A, B, C).
#
#   scripts/dp_auto_bench.sh                               # tiny small medium, 2 repeats
#   SIZES=small REPEATS=1 NUM_PROMPTS=16 scripts/dp_auto_bench.sh
#
# Settings (environment):
#   SIZES="tiny small medium"   random-weight Qwen2.5-VL (make-tiny --size; tiny: the tests')
#   SETTINGS="t1 t2 dp2"        t1: one engine, --num-threads 1; t2: one engine, 2 threads
#                               (--num-threads 2); dp2: --data-parallel-size 2 (one thread
#                               each, pinned); dp2o: dp2 with --overlap-prefill (each
#                               engine's prefills on a second thread on its own core, so its
#                               running rows keep stepping); auto: no flag (the defaults);
#                               d1: the defaults but --decode-threads 1; lp0: the defaults
#                               but --long-prefill-token-threshold 0 (no long-prefill chunks);
#                               d2o: one engine, its decode steps on 2 threads and its
#                               prefills and encoders on a second thread of 1 (--num-threads 1
#                               --decode-threads 2 --overlap-prefill)
#   REPEATS=2 NUM_PROMPTS=24 CONCURRENCY=8 OUTPUT_LEN=64 WARMUPS=2 PORT=18110
#   BUCKETS='{"480,640,1": 1.0}'   (one 480x640 image per request)
#   MODE=cold                     bench serve --mode: cold, or both (the cold phase, then the
#                                 same requests again warm: the caches' hits, mostly decode)
#   OUT=results/dp-auto-<date>
# Writes OUT/<size>-<setting>-r<N>.json (bench serve results) and OUT/summary.md: medians of
# each phase's requests/s, TPOT p50 and TTFT p50 per size and setting.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
APHRODITE="${APHRODITE:-$ROOT/.venv/bin/aphrodite}"
PY="${PY:-$ROOT/.venv/bin/python}"
SIZES="${SIZES:-tiny small medium}"
SETTINGS="${SETTINGS:-t1 t2 dp2}"
REPEATS="${REPEATS:-2}"
NUM_PROMPTS="${NUM_PROMPTS:-24}"
CONCURRENCY="${CONCURRENCY:-8}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
WARMUPS="${WARMUPS:-2}"
PORT="${PORT:-18110}"
BUCKETS="${BUCKETS:-{\"480,640,1\": 1.0\}}"
MODE="${MODE:-cold}"
OUT="${OUT:-$ROOT/results/dp-auto-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/logs"

say() { echo "dp_auto_bench: $*" >&2; }
SERVER=""
stop() {
  [ -z "$SERVER" ] && return
  kill -TERM -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 -- "-$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  SERVER=""
}
trap stop EXIT

flags_for() {  # setting -> serve flags
  case "$1" in
    t1) echo "--data-parallel-size 1 --num-threads 1" ;;
    t2) echo "--data-parallel-size 1 --num-threads 2" ;;
    dp2) echo "--data-parallel-size 2" ;;
    dp2o) echo "--data-parallel-size 2 --overlap-prefill" ;;
    auto) echo "" ;;
    d1) echo "--decode-threads 1" ;;
    lp0) echo "--long-prefill-token-threshold 0" ;;
    d2o) echo "--data-parallel-size 1 --num-threads 1 --decode-threads 2 --overlap-prefill" ;;
    *) say "unknown setting $1 (t1, t2, dp2, dp2o, auto, d1, lp0, d2o)"; exit 1 ;;
  esac
}

for size in $SIZES; do
  if [ "$size" = tiny ]; then model="tiny:qwen2_5_vl"; else
    model="$("$PY" -c "from engine.models.loader import tiny_model_dir as d; print(d(size='$size'))")"
  fi
  for r in $(seq "$REPEATS"); do
    for setting in $SETTINGS; do
      # shellcheck disable=SC2046  # the flags split into words
      setsid "$APHRODITE" serve "$model" --served-model-name m --host 127.0.0.1 --port "$PORT" \
        --max-num-seqs "$CONCURRENCY" --dtype float32 $(flags_for "$setting") \
        >"$OUT/logs/$size-$setting-r$r-server.log" 2>&1 &
      SERVER=$!
      start=$SECONDS
      until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1; do
        kill -0 "$SERVER" 2>/dev/null || { tail -n 20 "$OUT/logs/$size-$setting-r$r-server.log" >&2; exit 1; }
        [ $((SECONDS - start)) -lt 600 ] || { say "server not ready"; exit 1; }
        sleep 1
      done
      say "$size $setting repeat $r"
      "$APHRODITE" bench serve --base-url "http://127.0.0.1:$PORT" --model m \
        --dataset-name random-mm --bucket-config "$BUCKETS" --num-prompts "$NUM_PROMPTS" \
        --num-warmups "$WARMUPS" --max-concurrency "$CONCURRENCY" \
        --random-output-len "$OUTPUT_LEN" --mode "$MODE" --seed "$r" --ttft-from chunk \
        --result-dir "$OUT" --result-filename "$size-$setting-r$r.json" \
        >"$OUT/logs/$size-$setting-r$r.log" 2>&1 || say "  bench failed ($OUT/logs)"
      stop
    done
  done
done

"$PY" - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for path in sorted(out.glob("*-r*.json")):
    m = re.fullmatch(r"([^-]+)-([^-]+)-r\d+\.json", path.name)
    if not m:
        continue
    for phase, p in json.loads(path.read_text())["phases"].items():
        runs.setdefault((m[1], phase, m[2]), []).append(
            (p["request_throughput"], p["p50_tpot_ms"], p["p50_ttft_ms"]))
lines = ["| size | phase | setting | runs | req/s | TPOT p50 ms | TTFT p50 ms |",
         "|---|---|---|---|---|---|---|"]
for (size, phase, setting), rs in sorted(runs.items()):
    med = [statistics.median(v[i] for v in rs) for i in range(3)]
    lines.append(f"| {size} | {phase} | {setting} | {len(rs)} | {med[0]:.2f} | {med[1]:.1f} "
                 f"| {med[2]:.0f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
