#!/usr/bin/env bash
# Build .gpu/site.tar.xz: the Python packages scripts/gpu_check.sh needs beyond a CUDA image's
# own (python3 with torch, torchvision, numpy, opencv, pandas, matplotlib, aiohttp, rich,
# prometheus-client, pytest, hypothesis), for a GPU machine with no package index; the pinned
# typer and click travel too (an older typer there lacks what aphrodite_cli uses), and
# pytest-asyncio. Runs on a machine with an index; the wheels are for CPython $GPU_PY (3.12)
# on x86-64 Linux, pruned (samples, FFmpeg sources, duplicate library copies) and
# xz-compressed: about 36 MB. The 1080p benchmark clip travels too when this machine's cache
# has it (`bench video-decode` makes it once), so the GPU machine need not encode it.
# Usage: bash scripts/gpu_bundle.sh; then, there: GPU_SITE=.gpu/site.tar.xz bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PY:-3.12}
PACKAGES=(PyNvVideoCodec==2.2.4 av==18.1.0 transformers==5.24.0 filetype==1.2.0
          num2words==0.5.14 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 typing-extensions==4.16.0 pytest-asyncio==1.5.0
          pytest-aiohttp==1.1.1 typer==0.29.2 click==8.5.1 nvidia-ml-py==13.615.71)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheels" "${PACKAGES[@]}"
site="$work/site"; mkdir -p "$site"
for whl in "$work"/wheels/*.whl; do python3 -m zipfile -e "$whl" "$site"; done
# not needed at run time: PyNvVideoCodec's samples and FFmpeg source tarball, pip metadata
rm -rf "$site"/samples "$site"/pynvvideocodec-*.data "$site"/*.dist-info/RECORD
# the wheel holds three copies of each FFmpeg library; keep one and link the other names
for lib in "$site"/PyNvVideoCodec/lib*.so.*.*.*; do
  base=$(basename "$lib"); stem=${base%%.so.*}; major=${base#"$stem".so.}; major=${major%%.*}
  ln -sf "$base" "$site/PyNvVideoCodec/$stem.so.$major"; ln -sf "$base" "$site/PyNvVideoCodec/$stem.so"
done
if [ -d "${APHRODITE_CACHE_ROOT:-$HOME/.cache/aphrodite}" ]; then
  cache=${APHRODITE_CACHE_ROOT:-$HOME/.cache/aphrodite}
  mkdir -p "$work/cache/media"
  cp "$cache"/media/clip_width1920_height1080_* "$work/cache/media/" 2>/dev/null || true
fi
mkdir -p .gpu
tar -I "xz -T0" -cf .gpu/site.tar.xz -C "$work" site $( [ -d "$work/cache" ] && echo cache )
ls -la .gpu/site.tar.xz
