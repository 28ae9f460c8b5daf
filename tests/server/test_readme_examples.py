"""docs/serving.md's examples (curl and the openai client) run against a live server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import ServerProcess

README = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
pytestmark = pytest.mark.timeout(300)


def examples() -> tuple[list[str], str]:
    text = README.read_text()
    block = text[text.index("<!-- serve-examples:start -->"):
                 text.index("<!-- serve-examples:end -->")]
    bash = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    commands = re.split(r"\n(?=curl )", bash.strip())
    python = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    return commands, python


def test_readme_examples_run():
    commands, python = examples()
    assert len(commands) == 3
    server = ServerProcess("--expose-request-timings").wait_ready()
    try:
        port = f"localhost:{server.port}"
        outputs = []
        for command in commands:
            done = subprocess.run(["bash", "-c", command.replace("localhost:2242", port)],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
        assert json.loads(outputs[0])["data"][0]["id"] == "tiny-qwen2_5_vl"
        assert json.loads(outputs[1])["usage"]["completion_tokens"] > 0
        assert outputs[2].rstrip().endswith("data: [DONE]") and '"usage"' in outputs[2]
        done = subprocess.run([sys.executable, "-c", python.replace("localhost:2242", port)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "prefill_s" in done.stdout and "same prompt: True" in done.stdout
    finally:
        assert server.stop() == 0
