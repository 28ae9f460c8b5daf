#!/usr/bin/env bash
# The README's main-job command (until `bench` lands): make media, serve it over loopback HTTP,
# and run it through the serving path's policy, fetch and decode with `aphrodite media probe`,
# once accepted and once refused.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.venv/bin/aphrodite
work=$(mktemp -d)
trap 'kill "${server_pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT

$A media generate image "$work/cat.jpg" --width 1280 --height 720
$A media generate video "$work/clip.mp4" --seconds 2 --width 320 --height 240
$A media generate audio "$work/tone.wav" --seconds 2

port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/python -m http.server "$port" --bind 127.0.0.1 --directory "$work" >/dev/null 2>&1 &
server_pid=$!
for _ in $(seq 50); do
  .venv/bin/python -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null && break
  sleep 0.1
done

echo; echo "== an image over loopback HTTP, host allowed by --allowed-media-domains"
$A media probe "http://127.0.0.1:$port/cat.jpg" --allowed-media-domains 127.0.0.1
echo; echo "== a video from the allowed local folder"
$A media probe "file://$work/clip.mp4" --allowed-local-media-path "$work"
echo; echo "== audio as a base64 data URL"
echo "data:audio/wav;base64,$(base64 -w0 "$work/tone.wav")" | $A media probe -
echo; echo "== the same image without the allow-list: refused before any byte is fetched"
if $A media probe "http://127.0.0.1:$port/cat.jpg"; then
  echo "demo: expected a refusal" >&2; exit 1
fi
echo; echo "== the video's sampled frames, decoded by pyav, written as PNG"
$A media decode "file://$work/clip.mp4" --allowed-local-media-path "$work" --backend pyav \
  --num-frames 8 --out "$work/frames"
echo; echo "== sampled decoding per backend vs a full ffmpeg decode (10 s 1080p30 H.264 clip)"
$A bench video-decode --repeats 3
echo; echo "demo: done"
