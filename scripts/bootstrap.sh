#!/usr/bin/env bash
# Set up everything aphrodite needs, idempotently: Debian packages (FFmpeg's libraries and CLI,
# GStreamer's software decoders and Python bindings), then .venv with the package and its test
# extras. A second run with nothing to do takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(
  ffmpeg                                  # shared libraries for torchcodec; CLI for reference frames
  python3-gi python3-gst-1.0 gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0
  gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good
  gstreamer1.0-plugins-bad gstreamer1.0-libav   # the deepstream backend's software path
  chromium                                # the test that opens the HTML report in a browser
)

missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for pkg in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && \
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      PYTHON="$candidate"; break
    fi
  done
fi
[ -n "$PYTHON" ] || { echo "bootstrap: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.aphrodite-install-stamp
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing aphrodite and its test extras into .venv (first time: a few minutes)"
  log=.venv/pip-install.log
  if ! { .venv/bin/python -m pip install -q --upgrade pip && \
         .venv/bin/python -m pip install -q -e '.[test]'; } >"$log" 2>&1; then
    cat "$log" >&2; echo "bootstrap: pip install failed (log above)" >&2; exit 1
  fi
  .venv/bin/python -c 'import engine, aphrodite_cli, torch, torchcodec, av, cv2, transformers' \
    || { echo "bootstrap: the install did not import cleanly" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

# GStreamer's Python bindings come from Debian (same 3.11 ABI); expose just `gi` to the venv.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/gi ] && [ ! -e "$site/gi" ]; then
  ln -s /usr/lib/python3/dist-packages/gi "$site/gi"
fi

# The project's own modules as bytecode: every server process, engine and CLI run then reads
# them instead of compiling ~35 K lines again (where PYTHONDONTWRITEBYTECODE is set, nothing
# else would write them); quick when they are current.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 engine aphrodite_cli \
  || echo "bootstrap: some modules did not byte-compile (above); they compile when imported" >&2
