# Shared settings of the peer-comparison scripts (sourced by peer_vllm.sh and
# peer_vllm_processor.sh): the project's paths and vLLM's own venv outside the project.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
APHRODITE="$ROOT/.venv/bin/aphrodite"
PY="$ROOT/.venv/bin/python"

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PEER_CACHE="${PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aphrodite/peer-vllm}"  # models, results
# vLLM's own environment: the one `serve --engine vllm` uses, built (or found) by
# scripts/vllm_env.sh and linked as .venv-vllm
VENV="$ROOT/.venv-vllm"
STUBS="$VENV/aphrodite-stubs"
