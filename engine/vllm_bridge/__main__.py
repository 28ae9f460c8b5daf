"""``python -m engine.vllm_bridge``: the vLLM engine process (see :mod:`engine.vllm_bridge`);
its settings arrive as one JSON line on stdin (the secret connection key is never in argv)."""

from engine.vllm_bridge.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
