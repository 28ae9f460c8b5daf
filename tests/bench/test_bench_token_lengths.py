"""Prompts of an exact length in tokens (``--random-input-len``, ``--random-range-ratio``,
vLLM's ``prefix_repetition``): checked against the embedded tiny model server's own count,
``usage.prompt_tokens``, on the chat endpoint (its template's tokens taken off the text) and
on ``/v1/completions``."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from aphrodite_cli.bench.load import token_prompts as tp
from engine.errors import ConfigError
from tests.server_harness import BIN

#: the default server, shared with the other modules that ask for it (tests/served.py)
pytestmark = [pytest.mark.timeout(300), pytest.mark.serve()]


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_texts_are_exactly_the_asked_tokens_and_the_template_is_counted(tiny_tokenizer):
    chat = tp.TokenPrompts.build(tiny_tokenizer, chat=True)
    plain = tp.TokenPrompts.build(tiny_tokenizer, chat=False)
    rng = random.Random(0)
    assert all(_count(tiny_tokenizer, chat.text(n, rng)) == n for n in (1, 2, 17, 300))
    conversation = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": chat.text(10, rng)}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    assert chat.overhead > 0 and len(conversation) == 10 + chat.overhead
    assert plain.overhead == 0  # this tokenizer adds no BOS
    rows = tp.random_token_requests(chat, 40, input_len=100, output_len=20, range_ratio=0.25,
                                    seed=3, nonce=1)
    assert {length for _, length, _ in rows} <= set(range(75, 126))
    assert len({length for _, length, _ in rows}) > 10  # drawn, not fixed
    assert all(_count(tiny_tokenizer, text) == length - chat.overhead for text, length, _ in rows)
    assert all(15 <= out <= 25 for _, _, out in rows)
    assert rows == tp.random_token_requests(chat, 40, input_len=100, output_len=20,
                                            range_ratio=0.25, seed=3, nonce=1)


def test_prefix_repetition_shares_each_prefix_exactly(tiny_tokenizer):
    prompts = tp.TokenPrompts.build(tiny_tokenizer, chat=False)
    texts = tp.prefix_repetition_requests(prompts, 12, prefix_len=30, suffix_len=7,
                                          num_prefixes=3, seed=1, nonce=2)
    assert all(_count(tiny_tokenizer, t) == 37 for t in texts) and len(set(texts)) == 12
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    prefixes = {tuple(i[:30]) for i in ids}
    assert len(prefixes) == 3
    assert sorted(sum(tuple(i[:30]) == p for i in ids) for p in prefixes) == [4, 4, 4]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"input_len": 20, "output_len": 4, "range_ratio": 0.0}, "leaves no text"),
    ({"input_len": 100, "output_len": 1, "range_ratio": 0.5}, "--random-output-len 1"),
])
def test_lengths_that_cannot_be_written_are_one_line_errors(tiny_tokenizer, kwargs, says):
    chat = tp.TokenPrompts.build(tiny_tokenizer, chat=True)
    with pytest.raises(ConfigError) as info:
        tp.random_token_requests(chat, 2, seed=0, nonce=0, **kwargs)
    assert says in info.value.message and "\n" not in info.value.message


def test_the_default_tokenizer_is_the_targets_model_when_it_is_here(tiny_tokenizer_dir, tmp_path):
    assert tp.default_tokenizer(tiny_tokenizer_dir) == tiny_tokenizer_dir
    # the embedded server's name for its default model
    assert tp.default_tokenizer("tiny-qwen2_5_vl") == tiny_tokenizer_dir
    assert tp.default_tokenizer("tiny:qwen2_5_vl") == tiny_tokenizer_dir
    # the served name is an alias: the root GET /v1/models names is where the weights are
    assert tp.default_tokenizer("my-alias", root=tiny_tokenizer_dir) == tiny_tokenizer_dir
    assert tp.default_tokenizer("acme/vlm") == "acme/vlm"  # a Hub id, as vLLM's bench takes it
    assert tp.default_tokenizer("my-alias", root="acme/vlm") == "acme/vlm"
    assert tp.default_tokenizer(str(tmp_path)) is None  # a folder without a tokenizer
    assert tp.default_tokenizer("x" * 5000) is None  # a name too long to be a path
    for not_an_id in ("acme/../vlm", "../vlm", "acme/vlm/extra", "-acme/vlm", "acme vlm"):
        assert tp.default_tokenizer(not_an_id) is None, not_an_id
    with pytest.raises(ConfigError) as info:
        tp.resolve_tokenizer(None, "acme/\x1b[2Jvlm", "--random-input-len")
    assert "--random-input-len counts tokens" in info.value.message
    assert "\x1b" not in info.value.message and "--tokenizer" in info.value.hint


def test_a_hub_id_model_downloads_its_tokenizer_from_the_hub(hub, tiny_tokenizer_dir, tmp_path):
    """The target serves ``acme/vlm`` (a Hub id): its tokenizer comes from the (fake) Hub, the
    same tokenizer as the files put there; a Hub id the Hub does not hold is a one-line error
    naming the flag that picks another."""
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(tiny_tokenizer_dir):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")) or name in (
                "config.json", "chat_template.jinja", "chat_template.json"):
            shutil.copy(Path(tiny_tokenizer_dir) / name, repo / name)
    hub.add_repo("acme/vlm", repo)
    tokenizer, name, source = tp.resolve_tokenizer(None, "acme/vlm", "--random-input-len")
    assert (name, source) == ("acme/vlm", "the target's model")
    from transformers import AutoTokenizer

    here = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    text = "a picture of two cats on a sofa"
    assert tokenizer(text)["input_ids"] == here(text)["input_ids"]
    assert tokenizer.get_vocab() == here.get_vocab()
    with pytest.raises(ConfigError) as info:
        tp.resolve_tokenizer(None, "acme/missing", "--random-input-len")
    assert "'acme/missing' could not be loaded as a tokenizer" in info.value.message
    assert "\n" not in info.value.message and "--tokenizer" in info.value.hint


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": 5}', '{"cut', "[]"])
def test_a_broken_tokenizer_folder_is_a_one_line_error(tmp_path, content):
    from aphrodite_cli.bench.load.vllm_compat import load_tokenizer

    (tmp_path / "tokenizer.json").write_text(content)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(tmp_path))
    assert "--tokenizer" in info.value.message and "could not be loaded" in info.value.message


@pytest.fixture
def server(served):
    """The module's server (its ``serve`` mark, tests/served.py)."""
    return served


def _bench(server, tmp_path: Path, name: str, *args: str) -> dict:
    done = subprocess.run(
        [BIN, "bench", "serve", "--base-url", server.base, "--num-prompts", "6",
         "--num-warmups", "0", "--mode", "cold", "--output-len", "2", "--out-dir",
         str(tmp_path), "--result-filename", name, *args],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((tmp_path / name).read_text())


def test_the_servers_own_count_is_the_asked_length(server, tmp_path, tiny_tokenizer_dir):
    """--random-input-len 200 without --tokenizer (the target's model is the cached tiny
    one): every request's usage.prompt_tokens is 200 on chat (the template's tokens taken
    off the text) and on /v1/completions; prefix_repetition's are prefix + suffix + the
    template's tokens."""
    chat = _bench(server, tmp_path, "chat.json", "--dataset-name", "random",
                  "--random-input-len", "200")
    assert chat["input_tokens"]["source"] == "the target's model"
    assert chat["input_tokens"]["tokenizer"] == tiny_tokenizer_dir
    overhead = chat["input_tokens"]["server_counts_beyond_text"]
    assert overhead > 0
    rows = chat["requests"]["cold"]
    assert [r["prompt_tokens"] for r in rows] == [200] * 6
    assert [r["input_len"] for r in rows] == [200] * 6
    assert chat["phases"]["cold"]["total_input_tokens"] == 1200
    plain = _bench(server, tmp_path, "completions.json", "--backend", "openai",
                   "--dataset-name", "random", "--random-input-len", "200", "--tokenizer",
                   tiny_tokenizer_dir, "--random-range-ratio", "0.5")
    rows = plain["requests"]["cold"]
    assert all(abs(r["prompt_tokens"] - r["input_len"]) <= 1 for r in rows), rows
    assert len({r["input_len"] for r in rows}) > 1 and plain["input_tokens"]["source"] == \
        "--tokenizer"
    shared = _bench(server, tmp_path, "prefix.json", "--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len",
                    "16", "--prefix-repetition-num-prefixes", "2",
                    "--prefix-repetition-output-len", "3", "--max-concurrency", "1")
    rows = shared["requests"]["cold"]
    assert [r["prompt_tokens"] for r in rows] == [64 + 16 + overhead] * 6
    assert [r["output_tokens"] for r in rows] == [3] * 6
    # each prefix's later requests find it in the server's prefix cache
    assert shared["phases"]["cold"]["prefix_cache"]["cached_tokens"] > 0


def test_bad_token_flags_are_one_line_errors_before_anything_is_sent(tmp_path):
    for args, says in ((["--random-range-ratio", "0.5"], "--random-range-ratio needs"),
                       (["--random-input-len", "10", "--random-range-ratio", "1"],
                        "--random-range-ratio 1 is below 1"),
                       (["--random-input-len", "10", "--dataset-name", "jsonl"],
                        "--random-input-len writes the random dataset's prompts"),
                       (["--random-input-len", "10"], "neither a local folder"),
                       # a Hub id the Hub (offline here) cannot give
                       (["--random-input-len", "10", "--model", "acme/vlm"],
                        "'acme/vlm' could not be loaded as a tokenizer")):
        done = subprocess.run([BIN, "bench", "serve", "--base-url", "http://127.0.0.1:9",
                               "--model", "acme vlm", "--out-dir", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        said = done.stdout + done.stderr
        assert done.returncode == 2 and says in said and "Traceback" not in said, said


def test_a_mooncake_traces_shared_blocks_hit_the_servers_prefix_cache(server, tmp_path):
    """Equal hash ids are equal tokens: the second request of each pair shares its first
    block (64 tokens, --timed-trace-chunk-hash-size) with the first, and the server finds it
    cached; every prompt is its input_length plus the chat template's tokens."""
    rows = [{"timestamp": t, "input_length": 128, "output_length": 2, "hash_ids": ids}
            for t, ids in ((0, [1, 2]), (10, [1, 3]), (20, [4, 5]), (30, [4, 6]))]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = _bench(server, tmp_path, "mooncake.json", "--dataset-name", "mooncake",
                 "--dataset-path", str(trace), "--timed-trace-chunk-hash-size", "64",
                 "--max-concurrency", "1")
    overhead = doc["input_tokens"]["server_counts_beyond_text"]
    got = doc["requests"]["cold"]
    assert [r["prompt_tokens"] for r in got] == [128 + overhead] * 4
    cached = doc["phases"]["cold"]["prefix_cache"]["cached_tokens"]
    assert cached >= 2 * 64, doc["phases"]["cold"]["prefix_cache"]
