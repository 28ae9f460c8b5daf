"""docs/serving.md's examples (curl and the openai client) run against a live server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.serve("--expose-request-timings")
def test_readme_examples_run(served):
    commands, python = examples()
    assert len(commands) == 3
    port = f"localhost:{served.port}"
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


@pytest.mark.serve()
def test_the_endpoints_example_runs(served):
    """The endpoints example: /ping, /tokenize and /detokenize in vLLM's shapes, the client's
    X-Request-Id back (naming the answer), a salted chat with template variables, and usage
    on every streamed chunk (continuous_usage_stats)."""
    text = README.read_text()
    block = text[text.index("<!-- endpoints-example:start -->"):
                 text.index("<!-- endpoints-example:end -->")]
    bash = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    commands = re.split(r"\n(?=curl )", bash.strip())
    assert len(commands) == 5
    outputs = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command.replace("localhost:2242", f"localhost:{served.port}")],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    ping, tokenized, detokenized, chat, stream = outputs
    assert json.loads(ping) == {"status": "ok"}
    tokens = json.loads(tokenized)
    assert tokens["count"] == len(tokens["tokens"]) > 5
    assert isinstance(json.loads(detokenized)["prompt"], str)
    head, _, body = chat.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "x-request-id: order-42" in head.lower()
    answer = json.loads(body)
    assert answer["id"] == "chatcmpl-order-42" and answer["usage"]["completion_tokens"] == 4
    assert "stop_reason" in answer["choices"][0]
    chunks = [json.loads(line[6:]) for line in stream.splitlines()
              if line.startswith("data: {")]
    assert len(chunks) >= 3 and all(c.get("usage") for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]][-1] == 3
