"""The engine process of ``aphrodite serve --engine vllm``: vLLM's ``AsyncLLM`` behind this
server's wire (:mod:`engine.server.process.wire`).

It runs in vLLM's own environment (``.venv-vllm``: vLLM pins its own torch and
transformers), started by the launcher as ``python -m engine.vllm_bridge`` with this
repository on its path. So it imports only the standard library, numpy, vLLM, and the
stdlib-only parts of this project: the wire's messages, the shared-memory inputs and the
packing of decoded media (:mod:`engine.server.vllm_adapter.vllm_inputs`); nothing that needs this
project's torch or transformers (``tests/vllm/test_vllm_engine.py`` checks it in that
environment).
"""
