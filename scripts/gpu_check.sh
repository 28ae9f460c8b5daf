#!/usr/bin/env bash
# GPU checks for the video backends, on a machine with an NVIDIA GPU and driver (and package
# registry access). Installs what it needs, starts CUDA MPS, runs the GPU tests with
# APHRODITE_FAIL_WITHOUT_GPU=1 (a missing capability fails instead of skipping), compares GPU
# frames with CPU reference frames (mean absolute difference < 4 levels of 255, frame identity
# checked through the frame number drawn into each frame), and prints per-backend timings on
# the standard 1080p clip. Budget: under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: not an NVIDIA machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
bash scripts/bootstrap.sh
.venv/bin/python -m pip install -q 'PyNvVideoCodec==2.2.4'
if ! [ -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ]; then
  nvidia-cuda-mps-control -d || echo "gpu_check: could not start CUDA MPS (serve checks will say so)"
fi
APHRODITE_FAIL_WITHOUT_GPU=1 timeout 300 .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_video_gpu.py tests/test_video_exact.py -k "gpu or nvidia or pynv or deepstream"
timeout 200 .venv/bin/aphrodite bench video-decode --repeats 3 \
  --backends opencv,pyav,torchcodec,pynvvideocodec,deepstream,deepstream:decoder=software
