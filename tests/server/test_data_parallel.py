"""``serve --data-parallel-size N`` with this project's engine: N engine processes, each pinned
to its own CPUs with an even share of threads; requests routed by cache affinity within a
load bound (engine.server.process.engine_pool); /metrics and the cache resets over all of them."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine.cpus import engine_share, engine_threads
from engine.server.process.engine_pool import (
    AFFINITY_TOKENS,
    BALANCE_SLACK,
    affinity_key,
    merge_stats,
    pick,
    preferred,
)
from tests.fixtures import server_process, synthetic
from tests.server_harness import BIN, ServerProcess, free_port, wait_exit

MODEL = "tiny:qwen2_5_vl"
START = "Look closely at this picture and at every detail in it before you answer. " * 2


def test_each_engine_gets_its_own_slice_of_the_cpus():
    assert engine_share(0, 2, [0, 1]) == [0] and engine_share(1, 2, [0, 1]) == [1]
    # uneven: the first slices are one larger; together they are the CPUs, each once
    slices = [engine_share(i, 3, list(range(8))) for i in range(3)]
    assert slices == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert engine_share(1, 2, [4, 9, 12, 13]) == [12, 13]  # the CPUs allowed, not 0..n-1
    assert engine_share(0, 3, [0, 1]) is None  # fewer CPUs than engines: not pinned
    assert engine_share(0, 1, [0, 1]) is None  # one engine: as before
    assert engine_threads(2, cpus=2) == 1 and engine_threads(2, cpus=8) == 4
    assert engine_threads(3, cpus=2) == 1  # never 0


def test_smt_siblings_stay_in_one_engine(tmp_path):
    """Linux numbers each core's second thread after every core's first (here 0/2 and 1/3
    are the two cores): a slice of CPU numbers would put both engines on both cores."""
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3"), (4, "4")):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    cpus = [0, 1, 2, 3]
    assert [engine_share(i, 2, cpus, tmp_path) for i in range(2)] == [[0, 2], [1, 3]]
    # fewer cores than engines: slices of the CPUs themselves
    assert [engine_share(i, 4, cpus, tmp_path) for i in range(4)] == [[0], [1], [2], [3]]
    # a CPU whose topology cannot be read is a core of its own; ranges are read as such
    (tmp_path / "cpu4" / "topology" / "thread_siblings_list").write_text("4-5\n")
    # (cores {0,2}, {4}, {7}: the first slice one core larger)
    assert engine_share(0, 2, [0, 2, 4, 7], tmp_path) == [0, 2, 4]
    assert engine_share(1, 2, [0, 2, 4, 7], tmp_path) == [7]


def test_affinity_key_and_balance_bound():
    # the first media item decides, whatever the text around it
    assert affinity_key([1, 2, 3], ["img-a", "img-b"]) == affinity_key([9], ["img-a"])
    assert affinity_key([1, 2, 3], ["img-a"]) != affinity_key([1, 2, 3], ["img-b"])
    # text only: the prompt's start; what comes after AFFINITY_TOKENS does not count
    head = list(range(AFFINITY_TOKENS))
    assert affinity_key([*head, 1], []) == affinity_key([*head, 2, 3], [])
    assert affinity_key([5, *head], []) != affinity_key(head, [])
    # the same key, the same engine (a hash that does not change between processes);
    # different keys spread over the engines
    keys = [f"image {i}".encode() for i in range(400)]
    assert [preferred(k, 2) for k in keys] == [preferred(k, 2) for k in keys]
    share = sum(preferred(k, 2) for k in keys) / len(keys)
    assert 0.4 < share < 0.6, share
    assert {preferred(k, 3) for k in keys} == {0, 1, 2}
    # a key seen before: its engine while that is at most BALANCE_SLACK busier
    assert pick(1, 0, [0, BALANCE_SLACK]) == 1
    assert pick(1, 0, [0, BALANCE_SLACK + 1]) == 0
    # past it, or a new key: the least busy, where the key hashes among equals
    assert pick(None, 1, [0, 0]) == 1 and pick(None, 1, [0, 1]) == 0
    assert pick(None, 2, [5, 3, 2]) == 2 and pick(None, 0, [5, 3, 3]) == 1
    assert pick(0, 2, [BALANCE_SLACK + 4, 3, 3]) == 2  # (3 engines: the least busy tie)


def test_a_diverted_key_is_followed_to_its_new_engine(monkeypatch):
    """A key whose engine was too busy went to the other one, which now holds its prefix:
    its next request goes there too, not back to the engine it hashes to; the memory of
    keys is bounded (the least recently used are forgotten)."""
    import types

    from engine.server.process import engine_pool

    pool = engine_pool.EnginePool([types.SimpleNamespace(on_reset_mm_cache=[])
                                   for _ in range(2)])  # (choose never calls an engine)
    ids, image = [1, 2, 3], ["image-a"]
    home = preferred(affinity_key(ids, image), 2)
    assert pool.choose(ids, image) == home
    pool.loads[home] = BALANCE_SLACK + 1  # too busy: the other engine takes it
    assert pool.choose(ids, image) == 1 - home
    pool.loads[home] = 0
    assert pool.choose(ids, image) == 1 - home  # followed, though both are idle now
    monkeypatch.setattr(engine_pool, "AFFINITY_MEMORY", 3)
    for i in range(3):  # three newer keys push it out: back to where it hashes
        pool.choose([i], [f"other {i}"])
    assert pool.choose(ids, image) == home


def test_merged_stats_sum_counts_and_keep_the_largest_max():
    merged = merge_stats([{"rss_bytes": 10, "steps_total": 3, "batch_size_max": 4},
                          {"rss_bytes": 5, "steps_total": 1, "batch_size_max": 7}])
    assert merged == {"rss_bytes": 15, "steps_total": 4, "batch_size_max": 7}
    # one engine silent: its share is unknown, so the numbers are (NaN on /metrics)
    assert merge_stats([{"rss_bytes": 1}, None]) is None


def test_model_sharding_flags_need_engine_vllm():
    for flags, words in ((["--tensor-parallel-size", "2"], "--engine vllm"),
                         (["--pipeline-parallel-size", "2"], "--engine vllm"),
                         (["--data-parallel-size", "2", "--device", "cuda"], "--device cpu")):
        done = subprocess.run([str(BIN), "serve", MODEL, *flags, "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert flags[0] in done.stderr and words in done.stderr
        assert "Traceback" not in done.stderr


def _routed(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^aphrodite_engine_requests_routed_total\{engine="(\d+)"\} (\S+)$', text, re.M)}


def _image(seed: int) -> str:
    data = synthetic.make_image(96, 64, fmt="PNG", seed=seed)
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.timeout(500)
def test_two_engines_share_the_requests_and_keep_each_image_on_one():
    """Two engines, each on its own CPU: six different images asked about one after another
    go to both engines (the least busy rule alone would send every one to engine 0), and a
    second question about each image finds the first one's prefix in the engine that
    answered it; a burst on one prompt spills to the other engine; a prefix cache reset
    reaches both; an engine killed stops the server with its name."""
    server = ServerProcess(MODEL, "--data-parallel-size", "2", "--server-dev-mode").wait_ready()
    try:
        lines = [line for line in server.lines if re.match(r"engine \d", line)]
        assert [line.split(" ")[1] for line in lines] == ["0", "1"], server.output
        pids = server.processes()["engines"]
        assert len(set(pids)) == 2
        if len(os.sched_getaffinity(0)) >= 2:  # each pinned to its own CPUs, 1 thread each
            allowed = [re.search(r"^Cpus_allowed_list:\s*(\S+)", Path(
                f"/proc/{pid}/status").read_text(), re.M).group(1) for pid in pids]
            assert allowed[0] != allowed[1], allowed
            assert all("(CPUs " in line and "torch threads 1 (--num-threads)" in line
                       for line in lines), lines
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)

        def ask(image: str, question: str):
            return client.chat.completions.create(
                model=MODEL, max_tokens=3, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": START + question}]}]).usage

        images = [_image(seed) for seed in range(6)]
        first = [ask(image, "What colour is it?") for image in images]
        # (the chat template's start before the image is shared by all: only the image and
        # the text after it tell a second question about the same image apart)
        before = [u.prompt_tokens_details.cached_tokens for u in first]
        routed = _routed(server.base)
        assert set(routed) == {"0", "1"} and all(n > 0 for n in routed.values()), routed
        again = [ask(image, "What shape is it?") for image in images]
        cached = [u.prompt_tokens_details.cached_tokens for u in again]
        assert all(c > b + 16 for b, c in zip(before, cached, strict=True)), (before, cached)

        # A burst on one prompt: its engine takes BALANCE_SLACK + 1, the rest spill over
        before = _routed(server.base)

        def long(_: int) -> int:
            return client.completions.create(model=MODEL, prompt="Tell me a long story.",
                                             max_tokens=300, extra_body={"ignore_eos": True}
                                             ).usage.completion_tokens

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(long, range(8))) == [300] * 8
        after = _routed(server.base)
        spread = {k: after[k] - before[k] for k in after}
        assert sum(spread.values()) == 8 and min(spread.values()) > 0, spread

        with urllib.request.urlopen(urllib.request.Request(
                f"{server.base}/reset_prefix_cache", method="POST"), timeout=60) as resp:
            answer = json.load(resp)
        assert answer["reset"] is True and answer["engines"] == 2, answer
        # (the template's start is gone too: nothing is cached)
        assert ask(images[0], "What shape is it?").prompt_tokens_details.cached_tokens == 0

        os.kill(pids[1], signal.SIGKILL)
        assert wait_exit(server.proc, 60) == 1
        assert "engine process 1 exited unexpectedly" in server.output
        assert server.kill_group(grace=10) == []
    finally:
        server.stop(signal.SIGKILL)


def test_soak_samples_every_engine_of_the_process_file():
    doc = {"supervisor": 5, "engines": [81, 82], "api_servers": [90]}
    assert server_process.roles_of(doc) == {"supervisor": 5, "engine0": 81, "engine1": 82,
                                            "api0": 90}
    assert server_process.roles_of({**doc, "engines": [81]})["engine"] == 81
