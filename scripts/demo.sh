#!/usr/bin/env bash
# The README's main-job command: on the embedded default (tiny Qwen2.5-VL, generated media),
# run `bench serve` (cold media, then warm cache), `bench mm-processor` (with the CPU video
# backends) and `bench video-decode`, then write the report; the last line is its path.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.venv/bin/aphrodite
out="results/demo-$(date -u +%Y%m%d-%H%M%S)"
mkdir -p "$out"

echo "== bench serve --embedded: cold media vs warm cache (images and short videos over HTTP)"
$A bench serve --embedded --num-prompts 24 --num-warmups 2 --mode both --media-delivery http \
  --bucket-config '{"480,640,1": 0.5, "720,1280,1": 0.25, "240,320,16": 0.25}' \
  --max-concurrency 4 --output-len 16 --out-dir "$out"

echo; echo "== bench mm-processor: preprocessing cold vs warm, and video decode per CPU backend"
$A bench mm-processor --num-prompts 20 --video-backends opencv,pyav,torchcodec --out-dir "$out"

echo; echo "== bench video-decode: sampled decoding per backend vs a full ffmpeg decode (1080p)"
$A bench video-decode --repeats 3 --out-dir "$out"

echo
$A bench report "$out"/serve-*.json "$out"/mm-processor-*.json "$out"/video-decode-*.json \
  --out-dir "$out/report" | tail -n 2
