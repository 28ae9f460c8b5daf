#!/usr/bin/env bash
# The README's main-job command (until `bench serve` lands): the most complete real path.
# Generates media and serves it over loopback HTTP; starts `aphrodite serve` with the tiny
# Qwen2.5-VL; sends it image and video requests with the openai client; shows a policy refusal;
# then runs the preprocessing (cold vs warm), batching and per-backend video decode benchmarks,
# which write results/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.venv/bin/aphrodite
PY=.venv/bin/python
work=$(mktemp -d)
cleanup() {
  [ -n "${serve_pid:-}" ] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  [ -n "${media_pid:-}" ] && kill "$media_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

$A media generate image "$work/cat.jpg" --width 1280 --height 720
$A media generate video "$work/clip.mp4" --seconds 2 --width 320 --height 240
$A media generate audio "$work/tone.wav" --seconds 2

media_port=$(free_port)
$PY -m http.server "$media_port" --bind 127.0.0.1 --directory "$work" >/dev/null 2>&1 &
media_pid=$!

echo; echo "== media probe: an image over loopback HTTP, then a refusal (no allow-list)"
sleep 0.5
$A media probe "http://127.0.0.1:$media_port/cat.jpg" --allowed-media-domains 127.0.0.1
$A media probe "http://127.0.0.1:$media_port/cat.jpg" || true

port=$(free_port)
echo; echo "== aphrodite serve (tiny Qwen2.5-VL) on port $port"
$A serve --port "$port" --allowed-media-domains 127.0.0.1 \
  --media-io-kwargs '{"video": {"backend": "pyav", "num_frames": 8}}' > "$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 240); do
  grep -q "aphrodite serving" "$work/serve.log" && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 0.5
done
grep "aphrodite serving" "$work/serve.log"

BASE="http://127.0.0.1:$port/v1" MEDIA="http://127.0.0.1:$media_port" $PY - <<'PYEOF'
import os
from openai import OpenAI

client = OpenAI(base_url=os.environ["BASE"], api_key="unused")
media = os.environ["MEDIA"]
for kind, part in [("image", {"type": "image_url", "image_url": {"url": f"{media}/cat.jpg"}}),
                   ("video", {"type": "video_url", "video_url": {"url": f"{media}/clip.mp4"}})]:
    for attempt in ("cold", "warm"):
        reply = client.chat.completions.create(
            model="tiny-qwen2_5_vl", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}])
        ext = reply.model_extra["aphrodite"]
        t = ext["timings"]
        print(f"{kind:5s} {attempt}: {reply.usage.prompt_tokens} prompt tokens, cache hits "
              f"{ext['cache_hits']}, fetch {t['fetch_s'] * 1e3:.1f} ms, decode "
              f"{t['media_decode_s'] * 1e3:.1f} ms, processor {t['processor_s'] * 1e3:.1f} ms, "
              f"first token {t['first_token_s'] * 1e3:.1f} ms")
try:
    client.chat.completions.create(model="tiny-qwen2_5_vl", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}])
except Exception as err:  # the policy refuses before fetching
    print("refused:", err)
PYEOF
kill -TERM "$serve_pid"; wait "$serve_pid" || true; serve_pid=""

echo; echo "== preprocessing, cold (media never seen) vs warm (processor cache)"
$A bench mm-processor --num-prompts 20
echo; echo "== 8 concurrent requests sharing forward passes vs one after another"
$A bench batching
echo; echo "== sampled video decoding per backend vs a full ffmpeg decode (10 s 1080p30 H.264)"
$A bench video-decode --repeats 3
echo; echo "demo: done (results in results/)"
