#!/usr/bin/env bash
# GPU checks on a machine with an NVIDIA GPU and driver, each step under its own time limit;
# a failed step is reported and the next one runs (the summary at the end lists every step's
# exit status; the script exits 1 if any failed). At most about 8 minutes.
#   1. the machine: GPU, driver, torch's CUDA, FFmpeg libraries, GStreamer NVIDIA elements, MPS;
#   2. the GPU-marked tests with APHRODITE_FAIL_WITHOUT_GPU=1 (nothing can skip): NVDEC frames
#      against the CPU reference on every exactness clip (frame identity through the number
#      drawn into each frame, mean difference under 4 levels), deepstream's NVIDIA pipeline,
#      the engine on CUDA against the CPU (greedy tokens), and the decode budget's rules;
#   3. NVDEC's raw output order on open-GOP H.264 and Matroska (printed, for the record);
#      `bench video-decode` on the standard 1080p clip: pyav and opencv beside pynvvideocodec
#      with 1 and 2 hardware decoders (and deepstream's NVIDIA decoder);
#   4. CUDA MPS started; `aphrodite serve --device cuda` with the small random-weight
#      Qwen2.5-VL (make-tiny --size small), two API servers decoding video with
#      pynvvideocodec under a GPU decode budget; `bench serve` cold then warm (images and
#      short videos) with GPU telemetry from nvidia-smi; then one video whose frames exceed an
#      API server's share of the budget (413 naming --mm-ipc-gpu-memory-gb expected).
# Packages: GPU_SITE=FILE (made by scripts/gpu_bundle.sh where a package index is reachable)
# runs on the machine's own python3, which must hold a CUDA torch, with the bundle unpacked
# beside it: for GPU machines without a package index. Without GPU_SITE it bootstraps .venv
# and installs PyNvVideoCodec from the index. Logs and results go to GPU_OUT (default
# results/gpu-check-TIME); `--engine vllm` is not run here (vLLM's CUDA build is too large
# to carry to a machine without an index; with one: APHRODITE_VLLM=1 make setup first).
set -uo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: not an NVIDIA machine" >&2; exit 2; }
OUT_DIR=${GPU_OUT:-results/gpu-check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/check.log"
exec > >(tee -a "$LOG") 2>&1
if [ -n "${GPU_SITE:-}" ]; then
  unpack=${GPU_UNPACK:-/tmp/aphrodite-gpu}
  mkdir -p "$unpack" && tar -xJf "$GPU_SITE" -C "$unpack" || exit 2
  export PYTHONPATH="$unpack/site:$PWD" APHRODITE_CACHE_ROOT="$unpack/cache"
  PY=${GPU_PYTHON:-python3}
else
  bash scripts/bootstrap.sh || exit 2
  .venv/bin/python -m pip install -q 'PyNvVideoCodec==2.2.4' || exit 2
  PY=.venv/bin/python
fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}  # cpu: a dry run of this script's plumbing on any machine
export PY OUT_DIR DEVICE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
results=()

aph() { "$PY" -m aphrodite_cli.main "$@"; }

step() {  # step NAME SECONDS COMMAND...: run, time and record one check
  local name=$1 limit=$2; shift 2
  # GPU_STEPS="machine telemetry": only the steps named (all of them without it)
  if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then return 0; fi
  echo; echo "== $name (limit ${limit}s) $(date -u +%T)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@"
  local rc=$?
  results+=("$(printf '%-28s exit %3d  %4ds' "$name" "$rc" $((SECONDS - start)))")
  return $rc
}

machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  "$PY" -c "import transformers, av, PyNvVideoCodec as n; print('transformers',
transformers.__version__, 'av', av.__version__, 'PyNvVideoCodec', getattr(n, '__version__', '?'))"
  echo "system FFmpeg libraries (torchcodec needs them): $(ldconfig -p | grep -c 'libavcodec\.so')"
  echo "ffmpeg CLI: $(command -v ffmpeg || echo none)"
  echo "GStreamer Python bindings: $("$PY" -c 'import gi; print("yes")' 2>/dev/null || echo no)"
  for element in nvv4l2decoder nvvideoconvert; do
    echo "GStreamer $element: $(gst-inspect-1.0 "$element" >/dev/null 2>&1 && echo yes || echo no)"
  done
  echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo none)"
}

wait_ready() {  # wait_ready URL SECONDS PID: poll until the server answers (or PID exits)
  "$PY" - "$1" "$2" "$3" <<'PYEOF'
import os, sys, time, urllib.request
url, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it was ready")
    try:
        urllib.request.urlopen(url, timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit("server not ready in time")
PYEOF
}

over_budget() {  # one 1080p clip whose sampled frames exceed a process's share: expect a 413
  "$PY" - "$APHRODITE_CACHE_ROOT" <<'PYEOF'
import base64, glob, json, os, sys, urllib.error, urllib.request
root = sys.argv[1] or os.path.expanduser("~/.cache/aphrodite")
clip = sorted(glob.glob(f"{root}/media/clip_width1920_height1080_*"))[0]
url = "data:video/mp4;base64," + base64.b64encode(open(clip, "rb").read()).decode()
body = {"model": "small", "max_tokens": 4, "messages": [{"role": "user", "content": [
    {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What?"}]}]}
req = urllib.request.Request("http://127.0.0.1:2242/v1/chat/completions",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        status, text = r.status, r.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
print("status", status, text[:600])
sys.exit(0 if status == 413 and "--mm-ipc-gpu-memory-gb" in text else 1)
PYEOF
}

nvdec_order() {  # NVDEC's own output, frame by frame, on the two kinds the backend sends to pyav
  # (open-GOP H.264, Matroska): shows whether a new PyNvVideoCodec still gets them wrong
  "$PY" - <<'PYEOF'
import os, PyNvVideoCodec as nvc, torch
from engine.config import MediaLimits
from engine.media.video.scan import scan_video
from tests.fixtures import synthetic
from tests.video_clips import clip
for name in ("h264-open-gop", "mkv-no-frame-count"):
    data = clip(name)
    scan = scan_video(data, MediaLimits.from_env())
    fd = os.memfd_create("x"); os.write(fd, data)
    dec = nvc.SimpleDecoder(f"/proc/self/fd/{fd}", use_device_memory=True,
                            output_color_type=nvc.OutputColorType.RGB)
    seen = []
    while batch := dec.get_batch_frames(1):
        f = batch[0]
        seen.append((f.getPTS(), synthetic.read_frame_index(torch.from_dlpack(f).cpu().numpy())))
    print(name, "scan pts", scan.pts[:12], "len", len(scan.pts), "nvdec len", len(dec))
    print(name, "(pts, drawn number) in NVDEC's output order:", seen[:40], "count", len(seen))
PYEOF
}

serve_on_gpu() {
  local model=/tmp/aphrodite-gpu-small video_backend=pynvvideocodec
  aph model make-tiny qwen2_5_vl --size small --out "$model" || return 1
  if ! nvidia-cuda-mps-control -d; then
    echo "gpu_check: CUDA MPS did not start: serving with the pyav video backend instead"
    video_backend=pyav
  fi
  echo "MPS servers: $(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  aph serve "$model" --served-model-name small --device "$DEVICE" --port 2242 \
    --api-server-count 2 --mm-ipc-gpu-memory-gb 0.05 --server-dev-mode \
    --media-io-kwargs "{\"video\": {\"backend\": \"$video_backend\"}}" \
    >"$OUT_DIR/serve.log" 2>&1 &
  local server=$!
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.decoder,memory.used \
    --format=csv -l 1 >"$OUT_DIR/nvidia-smi.csv" 2>&1 &
  local smi=$!
  local rc=0
  if wait_ready http://127.0.0.1:2242/v1/models 100 "$server"; then
    aph bench serve --base-url http://127.0.0.1:2242 --model small --num-prompts 48 \
      --num-warmups 2 --max-concurrency 8 --output-len 64 --mode both \
      --bucket-config '{"480,640,1": 0.5, "720,1280,1": 0.25, "240,320,16": 0.25}' \
      --metrics-interval 0.5 \
      --out-dir "$OUT_DIR" --result-filename serve-cuda.json || rc=1
    "$PY" - "$OUT_DIR/serve-cuda.json" <<'PYEOF' || rc=1
import json, sys
doc = json.load(open(sys.argv[1]))
for phase, result in doc["phases"].items():
    tel = result["telemetry"]
    gpu = tel["gpu"]
    ticks = gpu.get("samples") or []
    util = [g.get("gpu_util_pct") for t in ticks for g in t["gpus"] if g.get("index") == 0]
    dec = [g.get("decoder_util_pct") for t in ticks for g in t["gpus"] if g.get("index") == 0]
    print(phase, "telemetry: /metrics samples", len(tel["metrics"]["samples"]), "gpu available",
          gpu["available"], gpu.get("reason") or "", "GPU 0 util % mean/max",
          util and round(sum(u or 0 for u in util) / len(util), 1), util and max(u or 0 for u in util),
          "NVDEC % max", dec and max(d or 0 for d in dec))
    assert tel["metrics"]["samples"] and gpu["available"] and ticks, "no telemetry"
PYEOF
    over_budget || rc=1
    echo "MPS clients: $(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  else
    rc=1
  fi
  kill -INT "$server" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server" "$smi" 2>/dev/null
  tail -n 25 "$OUT_DIR/serve.log"
  return $rc
}

export -f aph machine wait_ready over_budget nvdec_order serve_on_gpu
step machine 60 machine
step gpu-tests 120 env APHRODITE_FAIL_WITHOUT_GPU=1 "$PY" -m pytest -q -p no:cacheprovider -rfE \
  tests/media/test_video_gpu.py tests/unit/test_gpu_budget.py \
  tests/engine/test_llm.py::test_cuda_execution_matches_cpu_greedy
step nvdec-order 40 nvdec_order
step telemetry 60 "$PY" scripts/gpu_telemetry_check.py --load
step video-decode 90 aph bench video-decode --repeats 3 --out-dir "$OUT_DIR" \
  --backends pyav,opencv,pynvvideocodec:hw_decoders=1,pynvvideocodec:hw_decoders=2,deepstream:decoder=nvidia
step serve-cuda 180 serve_on_gpu

echo; echo "== summary"
printf '%s\n' "${results[@]}"
printf '%s\n' "${results[@]}" | grep -qv 'exit   0' && exit 1
exit 0
