"""``aphrodite serve --engine vllm``: this server's front door on vLLM's engine (vllm-cpu in
``.venv-vllm``, built by ``make setup-vllm``), over real HTTP with the ``openai`` client.

Class-scoped servers, one family at a time (each vLLM engine takes ~40-60 s to start on 2
cores and holds ~2 GB): ours on a tiny Qwen2.5-VL (the ``served`` server it shares with
tests/server/test_structured_outputs.py, tests/served.py), then on a tiny Qwen2-Audio
(head_dim 32: vLLM's CPU attention refuses 16), each beside vLLM's own OpenAI server on the
same folder for the prompt-token comparison; then ours with ``--tensor-parallel-size 2``. Without
``.venv-vllm`` the end-to-end tests skip with the build command, or fail under ``CI=true``
with the build's own error (``.venv-vllm.error``), so CI never passes by skipping them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.server.vllm_adapter import vllm_inputs
from engine.server.vllm_adapter.vllm_spec import bridge_env, carve_utilization
from tests import served as served_pool
from tests.engines import TOOLS_SERVER, VLLM_EAGER, VLLM_KV, tiny_model, vllm_python
from tests.fixtures import synthetic
from tests.media_server import MediaServer
from tests.server_harness import ServerProcess, free_port, wait_exit

openai = pytest.importorskip("openai")

#: vLLM's own server's KV space (ours: --kv-cache-memory-bytes, tests/engines.VLLM_KV)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
COMMON = ("--max-model-len", "2048", "--dtype", "float32", "--expose-request-timings",
          "--allowed-media-domains", "127.0.0.1", "--server-dev-mode")
#: vLLM's own server samples video as ours does by default (uniform, at most 32 frames)
VLLM_VIDEO = '{"video": {"video_backend": "opencv", "num_frames": 32}}'


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMAGE = data_url(synthetic.make_image(160, 120, fmt="PNG", seed=3), "image/png")
VIDEO = data_url(synthetic.make_video(width=128, height=96, fps=4, seconds=2.0), "video/mp4")
#: 16 kHz mono, the model's rate: vLLM's own server resamples with torchaudio, which vllm-cpu's
#: environment lacks (its CUDA build does not load), so it gets audio it need not resample
AUDIO = data_url(synthetic.make_audio(seconds=1.0, rate=16_000, channels=1), "audio/wav")
PARTS = {"image": {"type": "image_url", "image_url": {"url": IMAGE}},
         "video": {"type": "video_url", "video_url": {"url": VIDEO}},
         "audio": {"type": "audio_url", "audio_url": {"url": AUDIO}}}


def chat(*parts: dict, text: str = "Describe it.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class VllmServer:
    """vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)."""

    def __init__(self, model: Path) -> None:
        python = vllm_python()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # its own temporary files (IPC sockets, a rendezvous file) go where stop() removes them
        self.scratch = tempfile.mkdtemp(prefix="vllm-own-")
        self.log = open(os.path.join(self.scratch, "server.log"), "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048",
             "--dtype", "float32", "--media-io-kwargs", VLLM_VIDEO, *VLLM_EAGER],
            env={**bridge_env(python), **VLLM_ENV, "TMPDIR": self.scratch}, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 400) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                pytest.fail(f"vLLM's server exited: {self.log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        pytest.fail("vLLM's server did not start in time")
        raise AssertionError

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            if wait_exit(self.proc, 30) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def start_ours(arch: str, *extra: str) -> ServerProcess:
    vllm_python()
    return ServerProcess(str(tiny_model(arch)), "--engine", "vllm", *COMMON, *VLLM_KV,
                         *VLLM_EAGER, *extra)


def server_pair(arch: str, *extra: str):
    """Ours on a tiny model of ``arch`` and vLLM's own on the same folder, started together
    (their start-ups overlap), stopped when the class that uses them ends: one family's pair
    at a time, so at most two vLLM engines hold memory at once (~2 GB each on the CPU)."""
    ours = start_ours(arch, *extra)
    peer = VllmServer(tiny_model(arch))
    try:
        ours.wait_ready(600)
        assert ours.is_ready, ours.output
        peer.wait_ready(600)
        yield ours, peer
    finally:
        peer.stop()
        ours.stop(timeout=60)


def client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=180)


def model_id(base: str) -> str:
    return client(base).models.list().data[0].id


def check_chat(server: ServerProcess, modality: str, stream: bool) -> None:
    """One chat with a ``modality`` part, as JSON or streamed: this server's shapes, vLLM's
    prompt tokens, and the same greedy answer either way."""
    c = client(server.base)
    messages = chat(PARTS[modality])
    if not stream:
        reply = c.chat.completions.create(model=model_id(server.base), messages=messages,
                                          max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens > 20  # the item's tokens, expanded by vLLM
        assert reply.model_extra["aphrodite"]["mm_tokens"][modality] > 0
        return
    chunks = list(c.chat.completions.create(
        model=model_id(server.base), messages=messages, max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and chunks[-1].usage.completion_tokens == 6
    again = c.chat.completions.create(model=model_id(server.base), messages=messages,
                                      max_tokens=6, temperature=0)
    assert text == again.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.prompt_tokens == again.usage.prompt_tokens


def check_prompt_tokens(ours: ServerProcess, theirs: VllmServer, parts: tuple[str, ...]
                        ) -> None:
    """The same chat's prompt tokens from this server and from vLLM's own."""
    messages = chat(*(PARTS[p] for p in parts))
    usage = []
    for server in (ours, theirs):
        reply = client(server.base).chat.completions.create(
            model=model_id(server.base), messages=messages, max_tokens=4, temperature=0)
        usage.append(reply.usage.prompt_tokens)
    assert usage[0] == usage[1], f"ours {usage[0]}, vLLM's {usage[1]}"


# -- without vLLM: the pieces in this environment ------------------------------------------

def test_items_pack_and_unpack_as_vllm_takes_them():
    from PIL import Image

    image = Image.fromarray(np.zeros((4, 6, 3), np.uint8))
    frames = np.ones((3, 4, 6, 3), np.uint8)
    meta = {"total_num_frames": 30, "fps": 10.0, "frames_indices": [0, 10, 20]}
    samples = np.zeros(160, np.float32)
    packed = vllm_inputs.pack([("image", image, None, None), ("video", frames, meta, None),
                               ("audio", (samples, 16000), None, None),
                               ("image", image, None, None)])
    data = vllm_inputs.unpack(packed)
    assert [a.shape for a in data["image"]] == [(4, 6, 3), (4, 6, 3)]
    video, video_meta = data["video"][0]
    assert video.shape == (3, 4, 6, 3) and video_meta["frames_indices"] == [0, 10, 20]
    assert video_meta["do_sample_frames"] is False  # sampled already (vLLM's own rule)
    assert vllm_inputs.video_metadata({"total_num_frames": 3}, 3)["do_sample_frames"] is True
    assert data["audio"][0][1] == 16000 and data["audio"][0][0].dtype == np.float32


def test_a_left_out_item_reaches_vllm_as_none_under_its_uuid():
    """An item vLLM's processor cache holds goes as None with its name (vLLM's
    ``multi_modal_uuids``, which its processor takes instead of hashing): the list form even
    for one item (vLLM drops a modality whose data is a bare None); a named item with data
    keeps it; an item with neither is refused before it is sent."""
    from engine.server.process.wire import Submit
    from engine.vllm_bridge.serve import vllm_prompt

    left_out = vllm_inputs.left_out

    frames = np.ones((2, 4, 6, 3), np.uint8)
    packed = vllm_inputs.pack([("image", None, None, "key-a"),
                               ("video", frames, {"total_num_frames": 2}, "key-v"),
                               ("image", np.zeros((4, 6, 3), np.uint8), None, None)])
    assert left_out(packed)
    assert vllm_inputs.uuids(packed) == {"image": ["key-a", None], "video": ["key-v"]}
    assert vllm_inputs.unpack(vllm_inputs.pack([("video", None, None, "v"),
                                                ("audio", None, None, "a")])) == {
        "video": [None], "audio": [None]}
    prompt = vllm_prompt(Submit("r", [1], packed, {}, prompt="<image><video><image>"), packed)
    images = prompt["multi_modal_data"]["image"]
    assert images[0] is None and images[1].size == (6, 4)
    assert prompt["multi_modal_data"]["video"][0].shape == (2, 4, 6, 3)
    assert prompt["multi_modal_uuids"] == {"image": ["key-a", None], "video": ["key-v"]}
    one = vllm_inputs.pack([("image", None, None, "key-a")])
    assert vllm_prompt(Submit("r", [1], one, {}, prompt="<image>"), one)[
        "multi_modal_data"] == {"image": [None]}
    plain = vllm_inputs.pack([("audio", (np.zeros(8, np.float32), 16000), None, None)])
    assert not left_out(plain) and "multi_modal_uuids" not in vllm_prompt(
        Submit("r", [1], plain, {}, prompt="<audio>"), plain)
    with pytest.raises(ValueError, match="neither data nor a uuid"):
        vllm_inputs.pack([("image", None, None, None)])


def test_vllms_item_names_are_salted_per_tenant():
    """vLLM keys its processor and encoder caches by the item names it is given: a salted
    request's names are its salt's own, so tenants share neither (nor this server's ledger of
    what vLLM holds); unsalted names stay the content key."""
    from engine.processing.cache import content_hash, item_key
    from engine.processing.preprocess import MediaItem
    from engine.server.vllm_adapter.vllm_media import item_uuid

    item = MediaItem("image", encoded=b"pixels", media_kwargs={"background": "white"})
    plain = item_uuid("m", item, {"fps": 2})
    assert plain == item_key("m", "image", content_hash(b"pixels"), {"fps": 2},
                             {"background": "white"})
    salted = {item_uuid("m", item, {"fps": 2}, salt) for salt in ("a", "b", "key:1|a")}
    assert len(salted) == 3 and plain not in salted
    assert item_uuid("m", item, {"fps": 2}, "a") == item_uuid("m", item, {"fps": 2}, "a")


def test_the_ledger_forgets_by_its_byte_bound_and_on_reset():
    from engine.server.vllm_adapter.vllm_media import Ledger, estimate

    k = 1 << 14
    ledger = Ledger(3 * k)
    ledger.remember([("a", k), ("b", k), ("c", k)])
    assert all(ledger.holds(key) for key in "abc")
    ledger.remember([("d", k)])  # "a" was used least recently
    assert not ledger.holds("a") and ledger.holds("d")
    ledger.remember([("huge", 4 * k)])  # over the whole bound: never held
    assert not ledger.holds("huge") and ledger.holds("b")
    ledger.forget(["b"])
    assert not ledger.holds("b")
    assert ledger.clear() == 2 and not ledger.holds("d")
    assert not Ledger(0).enabled
    # an item vLLM lacked once (an eviction) is left out again; one it lacked twice (it does
    # not keep it) is always sent from then on, until a cache reset
    ledger.remember([("kept", k)])
    ledger.forget(["kept"])
    ledger.remember([("kept", k)])
    assert ledger.holds("kept")
    ledger.forget(["kept"])
    ledger.remember([("kept", k)])
    assert not ledger.holds("kept")
    ledger.clear()
    ledger.remember([("kept", k)])
    assert ledger.holds("kept")
    assert estimate("image", np.zeros((100, 200, 3), np.uint8)) == 60_000 * 8
    assert estimate("audio", (np.zeros(10_000, np.float32), 16000)) == 40_000
    assert estimate("image", np.zeros((1, 1, 3), np.uint8)) == 1 << 14  # the floor


def test_a_request_vllm_lacks_a_left_out_item_of_goes_once_more_with_the_data():
    """vllm_media.generate over a stand-in for the engine connection that answers as the
    bridge does: ``mm_data_needed`` before any token for a prompt with an item left out.
    The prompt goes once more with every item decoded, the left-out keys are forgotten and
    those sent remembered once it ran; a second refusal, or one after a token, reaches the
    client."""
    import asyncio

    from engine.errors import EngineError
    from engine.processing.preprocess import ProcessedPrompt
    from engine.server.process.wire import Delta, Done
    from engine.server.vllm_adapter.vllm_media import DATA_NEEDED, Ledger, generate

    class Bridge:
        def __init__(self, refusals: int, token_first: bool = False) -> None:
            self.refusals, self.token_first, self.seen = refusals, token_first, []

        async def generate(self, ids, mm, sampling, items, text, kwargs, priority=0,
                           cache_salt=None):
            self.seen.append(mm)
            if self.token_first:
                yield Delta("r", 0, 5, "x", None, None)
            if self.refusals > 0:
                self.refusals -= 1
                raise EngineError({"message": "lacks", "code": DATA_NEEDED}, 503)
            yield Done("r", [], {})

    def prompt() -> ProcessedPrompt:
        left = vllm_inputs.pack([("image", None, None, "held")])
        full = vllm_inputs.pack([("image", np.zeros((2, 2, 3), np.uint8), None, "held")])
        return ProcessedPrompt([1], left, [True], {}, {"image": 1}, mm_hashes=["held"],
                               text="<image>", refill=lambda: (full, [("held", 1 << 14)]))

    counted: list[list[bool]] = []  # the processor cache's lookups, counted once it ran

    async def run(bridge: Bridge, ledger: Ledger, resends: list) -> list:
        return [m async for m in generate(bridge, ledger, prompt(), {},
                                          lambda: resends.append(1),
                                          on_items=counted.append)]

    ledger, resends = Ledger(1 << 20), []
    ledger.remember([("held", 1 << 14)])
    bridge = Bridge(refusals=1)
    assert isinstance(asyncio.run(run(bridge, ledger, resends))[-1], Done)
    assert [vllm_inputs.left_out(mm) for mm in bridge.seen] == [True, False]
    assert resends == [1] and ledger.holds("held")  # forgotten, then remembered once it ran
    assert counted == [[False]]  # the left-out item was a miss after all: sent with its data
    assert isinstance(asyncio.run(run(Bridge(refusals=0), ledger, []))[-1], Done)
    assert counted == [[False], [True]]  # left out, and vLLM had it: a hit
    for refused in (Bridge(refusals=2), Bridge(refusals=1, token_first=True)):
        with pytest.raises(EngineError):
            asyncio.run(run(refused, Ledger(1 << 20), []))
        assert len(refused.seen) == (1 if refused.token_first else 2)

    # the resend decodes inside the API server's preprocessing slot: with every slot taken
    # (server.prepare.preprocess_slot), it is that slot's 503, and nothing is decoded
    from types import SimpleNamespace

    from engine.errors import OverloadedError
    from engine.server.api.prepare import preprocess_slot

    state = SimpleNamespace(preprocessing=2, config=SimpleNamespace(max_decode_queue=2))
    decoded = []
    full = prompt()
    refill = full.refill
    full.refill = lambda: decoded.append(1) or refill()

    async def crowded() -> list:
        return [m async for m in generate(Bridge(refusals=1), Ledger(1 << 20), full, {},
                                          lambda: resends.append(1),
                                          slot=lambda: preprocess_slot(state))]

    resends = []
    with pytest.raises(OverloadedError) as refused:
        asyncio.run(crowded())
    assert refused.value.code == "decode_queue_full" and decoded == [] and resends == []
    state.preprocessing = 1  # a slot free: the resend takes it, and gives it back
    state.count = lambda preprocessing: setattr(state, "preprocessing",
                                                state.preprocessing + preprocessing)
    assert isinstance(asyncio.run(crowded())[-1], Done)
    assert decoded == [1] and resends == [1] and state.preprocessing == 1


def test_vllm_flags_pass_through_by_vllms_names():
    from engine.config import EngineConfig, ParallelConfig, PipelineConfig, VllmConfig
    from engine.server.config import ServerConfig
    from engine.server.vllm_adapter.vllm_spec import engine_args

    config = ServerConfig(
        engine_kind="vllm", max_model_len=4096,
        engine=EngineConfig(max_num_seqs=32, enable_prefix_caching=False, dtype="bfloat16",
                            max_num_batched_tokens=8192),
        pipeline=PipelineConfig(limit_mm_per_prompt={"image": 2}, mm_processor_cache_gb=2.5),
        parallel=ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2,
                                data_parallel_size=2, distributed_executor_backend="ray"),
        vllm=VllmConfig(gpu_memory_utilization=0.8))
    args = engine_args(config, "/models/m", "m")
    assert {k: args[k] for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                 "data_parallel_size", "distributed_executor_backend",
                                 "gpu_memory_utilization", "max_num_seqs", "max_model_len",
                                 "enable_prefix_caching", "dtype", "max_num_batched_tokens",
                                 "limit_mm_per_prompt")} == {
        "tensor_parallel_size": 4, "pipeline_parallel_size": 2, "data_parallel_size": 2,
        "distributed_executor_backend": "ray", "gpu_memory_utilization": 0.8,
        "max_num_seqs": 32, "max_model_len": 4096, "enable_prefix_caching": False,
        "dtype": "bfloat16", "max_num_batched_tokens": 8192, "limit_mm_per_prompt": {"image": 2}}
    assert args["mm_processor_cache_gb"] == 2.5  # the API servers' ledgers are sized by it
    assert "block_size" not in args  # vLLM's default, as ours
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                    block_size=32))
    assert engine_args(config, "/models/m", "m")["block_size"] == 32
    assert "scheduling_policy" not in args  # fcfs: vLLM's default, as ours
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, scheduling_policy="priority"))
    assert engine_args(config, "/models/m", "m")["scheduling_policy"] == "priority"
    assert "long_prefill_token_threshold" not in args  # unset: vLLM's default (off)
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, long_prefill_token_threshold=256))
    assert engine_args(config, "/models/m", "m")["long_prefill_token_threshold"] == 256
    from engine.server.vllm_adapter.vllm_spec import ours_only_flags

    assert ours_only_flags(config.engine) == []
    assert [flag for flag, _ in ours_only_flags(dataclasses.replace(
        config.engine, scheduling_policy="shortest"))] == ["--scheduling-policy shortest"]
    with pytest.raises(ConfigError, match="--distributed-executor-backend"):
        ParallelConfig(distributed_executor_backend="slurm")
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        ParallelConfig(tensor_parallel_size=0)


def test_max_model_len_over_the_models_is_capped_for_vllm(tmp_path):
    """vLLM refuses a --max-model-len over the model's limit (the server's default 8192 on a
    4096-position model): the server serves with the model's and says so."""
    from engine.server.config import ServerConfig
    from engine.server.engines import VllmEngines
    from engine.server.vllm_adapter.vllm_spec import model_max_len

    (tmp_path / "config.json").write_text(json.dumps(
        {"text_config": {"max_position_embeddings": 4096}, "max_position_embeddings": 128}))
    assert model_max_len(str(tmp_path)) == 4096
    said = []
    fitted = VllmEngines().fit(ServerConfig(engine_kind="vllm"), str(tmp_path), said.append)
    assert fitted.max_model_len == 4096 and "8192" in said[0]
    kept = VllmEngines().fit(ServerConfig(engine_kind="vllm", max_model_len=2048),
                             str(tmp_path), said.append)
    assert kept.max_model_len == 2048 and len(said) == 1


def test_mm_ipc_budget_comes_out_of_vllms_share():
    gib = 1 << 30
    assert carve_utilization(0.9, 0, 80 * gib) == 0.9
    assert carve_utilization(0.9, 8 * gib, 80 * gib) == pytest.approx(0.8)
    with pytest.raises(ConfigError, match="mm-ipc-gpu-memory-gb"):
        carve_utilization(0.5, 40 * gib, 80 * gib)


def test_bench_embedded_engine_flags_are_checked_before_anything_starts():
    from aphrodite_cli.bench.load.target import Target

    with pytest.raises(ConfigError, match="needs --model"):
        Target(embedded=True, engine="vllm")
    with pytest.raises(ConfigError, match="--embedded"):
        Target("http://127.0.0.1:8000", engine="vllm")
    target = Target(embedded=True, engine="vllm", model="/models/tiny")
    assert target.server_args[:2] == ("--engine", "vllm")


def test_a_request_without_max_tokens_is_capped_for_vllm_as_for_ours():
    """vLLM would otherwise generate up to the model length (32k on a large model); it gets
    the server's cap, and its scheduler stops at the model length if that comes first."""
    from engine.server.api.protocol import parse_generation_fields
    from engine.server.api.respond import sampling_for_engine

    fields = parse_generation_fields({"messages": []}, max_tokens_cap=300)
    params = fields.sampling_for(10, 32768, "messages")
    assert sampling_for_engine(params, fields, vllm=True)["max_tokens"] == 300
    assert sampling_for_engine(params, fields, vllm=False)["max_tokens"] == 300
    given = parse_generation_fields({"messages": [], "max_tokens": 7}, max_tokens_cap=300)
    assert sampling_for_engine(given.sampling_for(10, 32768, "messages"), given,
                               vllm=True)["max_tokens"] == 7



def test_a_json_schema_goes_to_vllm_as_our_engine_compiles_it():
    """vLLM's xgrammar (0.2.8) let a length-bounded string hold a raw control character
    (``"nm":"P/\x14"``: no JSON); the schema reaches vLLM with such strings as the pattern
    our engine compiles them with; other constraints go as they came."""
    from engine.server.api.protocol import parse_generation_fields
    from engine.server.api.respond import sampling_for_engine

    schema = {"type": "object", "properties": {"nm": {"type": "string", "maxLength": 3}}}
    fields = parse_generation_fields({"messages": [], "structured_outputs": {"json": schema}},
                                     max_tokens_cap=64)
    params = fields.sampling_for(10, 2048, "messages")
    sent = sampling_for_engine(params, fields, vllm=True)["structured_outputs"]
    assert json.loads(sent.text)["properties"]["nm"] == {"type": "string",
                                                         "pattern": "[^\\x00-\\x1f]{0,3}"}
    assert sent.param == "structured_outputs.json"
    assert sampling_for_engine(params, fields, vllm=False)["structured_outputs"] == \
        params.structured_outputs  # (our engine rewrites it when it compiles)
    regex = parse_generation_fields({"messages": [], "guided_regex": "[a-z]{3}"},
                                    max_tokens_cap=64)
    spec = regex.sampling_for(10, 2048, "messages").structured_outputs
    assert sampling_for_engine(regex.sampling_for(10, 2048, "messages"), regex,
                     vllm=True)["structured_outputs"] == spec

@pytest.mark.parametrize(("flag", "value"), [("--num-threads", "2"), ("--decode-threads", "1"),
                                             ("--device", "cuda"),
                                             ("--prefix-cache-gb", "1"),
                                             ("--encoder-cache-gb", "0")])
def test_our_engines_own_flags_are_refused_with_vllm_not_ignored(flag, value):
    """They would have no effect on vLLM's engine: a one-line error naming the flag and what
    to use instead, exit 2, before vLLM's environment is even looked for."""
    result = subprocess.run([sys.executable, "-m", "aphrodite_cli.main", "serve", "--engine",
                             "vllm", flag, value, "--vllm-python", "/nonexistent/python",
                             "--port", str(free_port())], capture_output=True, text=True,
                            timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert f"{flag} sets this project's engine" in out and "--engine vllm" in out
    assert "make setup-vllm" not in out and "Traceback" not in out


def test_missing_vllm_environment_is_one_line_naming_the_build():
    result = subprocess.run([sys.executable, "-m", "aphrodite_cli.main", "serve", "--engine",
                             "vllm", "--vllm-python", "/nonexistent/python", "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "make setup-vllm" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


#: vLLM 0.32's CPU worker's two memory refusals at start-up (vllm/v1/worker/cpu_worker.py),
#: as its engine core process writes them
REFUSALS = (
    "(EngineCore pid=9) ValueError: Available memory on node 0 (20.66/23.54 GiB) on startup "
    "is less than desired CPU memory utilization (0.9, 21.19 GiB). On the CPU backend, the "
    "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite "
    "its name). To resolve: decrease `--gpu-memory-utilization` (e.g. "
    "`--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.",
    "ValueError: Available memory on node 0 (2.10/23.54 GiB) on kv cache allocation is less "
    "than requested memory for kv (4.00 GiB). Decrease --kv-cache-memory-bytes, "
    "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.")


def test_vllms_memory_refusals_become_one_line_naming_our_flag():
    """vLLM's CPU worker refuses to start unless 90% of the memory is free (without a KV
    cache size), or when the KV cache does not fit: each is a one-line error naming
    --kv-cache-memory-bytes and the memory free; other lines are no refusal."""
    from engine.server.vllm_adapter.vllm_startup import RefusalWatch, startup_refusal

    wants, too_big = (startup_refusal(line) for line in REFUSALS)
    assert wants is not None and too_big is not None
    assert "20.66 of 23.54 GiB free" in wants.message and "4G" in wants.hint
    assert "2.10 of 23.54 GiB free" in too_big.message and "lower" in too_big.hint
    for error in (wants, too_big):
        assert "--kv-cache-memory-bytes" in error.hint and "\n" not in str(error)
    assert startup_refusal("INFO Available memory on node 0 (20.66/23.54 GiB)") is None
    assert startup_refusal("less than desired CPU memory utilization") is None
    read, write = os.pipe()
    with tempfile.TemporaryFile("w+") as passed:
        watch = RefusalWatch(os.fdopen(read, "rb"), passed)
        with os.fdopen(write, "wb") as pipe:
            pipe.write(b"INFO loading\n" + REFUSALS[1].encode() + b"\nlater\n")
        watch.thread.join(10)
        passed.seek(0)
        assert passed.read().splitlines() == ["INFO loading", REFUSALS[1], "later"]
    assert watch.refusal is not None and "does not fit" in watch.refusal.message


def test_kv_cache_size_by_vllms_flag_and_its_refusal_from_serve(tmp_path):
    """--kv-cache-memory-bytes (vLLM's name and units) reaches vLLM's engine arguments; the
    bridge sizes it on a CPU when left out. A vLLM that refuses at start (a stand-in printing
    vLLM's words) is a one-line error naming the flag, exit 2, no traceback."""
    from engine.config import VllmConfig
    from engine.server.config import ServerConfig
    from engine.server.vllm_adapter.vllm_spec import byte_count, engine_args

    assert byte_count("--f", "4G") == 4 << 30 and byte_count("--f", "1.5g") == 1_500_000_000
    assert byte_count("--f", " 2048 ") == 2048
    for bad in ("", "G", "-1G", "0", "1.5", "4X", "nanG", "1e300G"):
        with pytest.raises(ConfigError, match="--f"):
            byte_count("--f", bad)
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes"):
        VllmConfig(kv_cache_memory_bytes=0)
    sized = ServerConfig(engine_kind="vllm", vllm=VllmConfig(kv_cache_memory_bytes=1 << 30))
    assert engine_args(sized, "/m", "m")["kv_cache_memory_bytes"] == 1 << 30
    assert "kv_cache_memory_bytes" not in engine_args(ServerConfig(engine_kind="vllm"),
                                                      "/m", "m")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nread spec\necho 'INFO starting' >&2\n"
                    f"echo '{REFUSALS[0]}' >&2\nexit 1\n")
    fake.chmod(0o755)
    result = subprocess.run([sys.executable, "-m", "aphrodite_cli.main", "serve",
                             str(tiny_model("qwen2_5_vl")), "--engine", "vllm",
                             "--vllm-python", str(fake), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "20.66 of 23.54 GiB free" in errors[0], out
    assert "hint: give vLLM's KV cache a size with --kv-cache-memory-bytes" in out
    assert "Traceback" not in out


def test_real_vllms_kv_refusal_is_one_line_naming_our_flag():
    """Real vllm-cpu asked for a KV cache larger than the machine (--kv-cache-memory-bytes
    1T): its worker's refusal, written by its engine core process, is the server's one-line
    error naming the flag, exit 2, no traceback (the stand-in above prints vLLM 0.32's
    words; this checks they are still vLLM's)."""
    vllm_python()
    result = subprocess.run([sys.executable, "-m", "aphrodite_cli.main", "serve",
                             str(tiny_model("qwen2_5_vl")), "--engine", "vllm", *COMMON[:4],
                             *VLLM_EAGER, "--kv-cache-memory-bytes", "1T",
                             "--port", str(free_port())],
                            capture_output=True, text=True, timeout=280,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = result.stdout + result.stderr
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert result.returncode == 2 and len(errors) == 1, out[-3000:]
    assert "does not fit this machine's memory" in errors[0] and "GiB free" in errors[0]
    assert "hint: lower --kv-cache-memory-bytes" in out
    assert "Enforce eager set" in out  # --enforce-eager reached vLLM (it logs this line)
    assert "Traceback" not in out[out.index(errors[0]):]

def test_bridge_imports_no_torch_nor_our_engine_in_vllms_environment():
    python = vllm_python()
    code = ("import sys, json; import engine.vllm_bridge.serve; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'vllm', 'engine'))))")
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                            env=bridge_env(python), cwd="/", timeout=120, check=True)
    loaded = set(json.loads(result.stdout))
    allowed = {"engine", "engine.version", "engine.errors", "engine.server",
               "engine.server.process", "engine.server.process.wire",
               "engine.server.process.engine_side",
               "engine.server.process.shared_inputs", "engine.server.process.outbox",
               "engine.server.vllm_adapter", "engine.server.vllm_adapter.vllm_inputs",
               "engine.server.vllm_adapter.vllm_spec", "engine.media",
               "engine.media.frame_memory", "engine.vllm_bridge", "engine.vllm_bridge.serve"}
    assert loaded <= allowed, loaded - allowed  # vllm (and its torch) load only in main()


# -- end to end ---------------------------------------------------------------------------

@pytest.mark.engines("vllm")
@pytest.mark.serve(*TOOLS_SERVER)
class TestQwen25VL:
    """Image and video through ``serve --engine vllm`` on a tiny Qwen2.5-VL, beside vLLM's own
    server on the same folder. Ours is the ``served`` server of
    tests/server/test_structured_outputs.py (``TOOLS_SERVER``: one vLLM start-up for both;
    its tools template renders a chat without tools as the model's own does)."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, served):
        # started with ours (served.BESIDE, below the class), unless another test's
        # selection started ours without it
        peer = served_pool.take(served.key) or VllmServer(tiny_model("qwen2_5_vl"))
        try:
            peer.wait_ready(600)
            yield {"qwen": served, "peer": peer}
        finally:
            peer.stop()

    @pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
    @pytest.mark.parametrize("modality", ["image", "video"])
    def test_chat_with_media(self, servers, modality, stream):
        check_chat(servers["qwen"], modality, stream)

    @pytest.mark.parametrize("parts", [(), ("image",), ("video",), ("image", "image")],
                             ids=["text", "image", "video", "two-images"])
    def test_prompt_tokens_equal_vllms_own_server(self, servers, parts):
        check_prompt_tokens(servers["qwen"], servers["peer"], parts)

    def test_text_completion_tokens_equal_vllms_own_server(self, servers):
        counts = []
        for server in (servers["qwen"], servers["peer"]):
            reply = client(server.base).completions.create(
                model=model_id(server.base), prompt=["Once upon a time", "hi"], max_tokens=3,
                temperature=0)
            assert len(reply.choices) == 2 and reply.usage.completion_tokens == 6
            counts.append(reply.usage.prompt_tokens)
        assert counts[0] == counts[1]

    def test_n_stop_and_logprobs_keep_this_servers_shapes(self, servers):
        base = servers["qwen"].base
        c = client(base)
        reply = c.chat.completions.create(model=model_id(base), messages=chat(PARTS["image"]),
                                          max_tokens=5, n=2, temperature=1.0, seed=7,
                                          logprobs=True, top_logprobs=3)
        assert sorted(ch.index for ch in reply.choices) == [0, 1]
        assert reply.usage.completion_tokens == sum(len(ch.logprobs.content)
                                                    for ch in reply.choices) == 10
        top = reply.choices[0].logprobs.content[0].top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[-1].logprob
        free = c.chat.completions.create(model=model_id(base), messages=chat(PARTS["image"]),
                                         max_tokens=12, temperature=0)
        word = free.choices[0].message.content[3:6]
        if word.strip():
            stopped = c.chat.completions.create(model=model_id(base), messages=chat(PARTS["image"]),
                                                max_tokens=12, temperature=0, stop=[word])
            assert stopped.choices[0].finish_reason == "stop"
            assert word not in stopped.choices[0].message.content

    def test_policy_refusal_fetches_nothing(self, servers):
        media = MediaServer()
        try:
            base = servers["qwen"].base
            url = media.base_url.replace("127.0.0.1", "localhost") + "/img.png"  # not allowed
            with pytest.raises(openai.BadRequestError) as err:
                client(base).chat.completions.create(
                    model=model_id(base), max_tokens=2,
                    messages=chat({"type": "image_url", "image_url": {"url": url}}))
            assert "allowed" in str(err.value.body).lower() or "domain" in str(err.value.body)
            assert media.total_hits == 0
            allowed = media.base_url + "/img.png"
            client(base).chat.completions.create(
                model=model_id(base), max_tokens=2,
                messages=chat({"type": "image_url", "image_url": {"url": allowed}}))
            assert media.hits["/img.png"] == 1
        finally:
            media.stop()

    @pytest.mark.parametrize("modality,mime", [("image", "image/png"), ("video", "video/mp4")])
    def test_malformed_file_is_a_4xx(self, servers, modality, mime):
        base = servers["qwen"].base
        bad = data_url(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 64, mime)
        part = {"type": f"{modality}_url", f"{modality}_url": {"url": bad}}
        with pytest.raises(openai.APIStatusError) as err:
            client(base).chat.completions.create(model=model_id(base), max_tokens=2,
                                                 messages=chat(part))
        assert 400 <= err.value.status_code < 500, err.value.body

    def test_vllms_refusal_is_a_400_and_the_same_media_then_runs(self, servers):
        """Our length check counts the placeholders unexpanded; vLLM refuses the expanded prompt
        (text just under --max-model-len 2048 plus an image) and that reaches the client as a
        400. The refusal leaves vLLM's processor cache believing its engine has the image (vLLM
        0.32 then ends the next request with that image with its retryable "error"): the bridge
        submits it again, so the client sees an answer, streamed or not."""
        base = servers["qwen"].base
        c = client(base)
        image = data_url(synthetic.make_image(224, 168, fmt="PNG", seed=11), "image/png")
        part = {"type": "image_url", "image_url": {"url": image}}
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=model_id(base), max_tokens=4,
                                      messages=chat(part, text="hi " * 670))  # ~2034 tokens
        body = json.dumps(err.value.body)
        assert "Traceback" not in body and "longer than the maximum model length" in body
        chunks = list(c.chat.completions.create(model=model_id(base), max_tokens=3, stream=True,
                                                messages=chat(part), temperature=0))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        reply = c.chat.completions.create(model=model_id(base), max_tokens=3, messages=chat(part))
        assert reply.choices[0].finish_reason == "length"

    def test_stage_timings_and_metrics(self, servers):
        base = servers["qwen"].base
        # vLLM's CPU KV space is this server's --kv-cache-memory-bytes 1G (no env var set)
        assert "Explicitly set (1.0/" in servers["qwen"].output
        body = json.dumps({"model": model_id(base), "max_tokens": 3,
                           "messages": chat(PARTS["video"])}).encode()
        request = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=180) as response:
            timings = json.loads(response.headers["x-aphrodite-timings"])
        for stage in ("fetch_s", "media_decode_s", "processor_s", "queue_s", "prefill_s",
                      "decode_s", "server_total_s"):
            assert stage in timings, timings
        assert timings["media_decode_s"] > 0 and timings["prefill_s"] > 0
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                       for line in response.read().decode().splitlines()
                       if line and not line.startswith("#")}
        assert metrics['aphrodite_stage_seconds_count{stage="media_decode"}'] >= 1
        assert metrics['aphrodite_stage_seconds_count{stage="prefill"}'] >= 1
        assert metrics["aphrodite_engine_stats_up"] == 1  # the bridge answers the stats query
        assert metrics["aphrodite_engine_rss_bytes"] > 0
        assert any(k.startswith("vllm:prompt_tokens_total") and v > 0 for k, v in metrics.items())

    def test_cache_salt_reaches_vllms_prefix_cache(self, servers):
        """cache_salt in the request (not only by API key, which tests/server/test_server.py
        runs on both engines, as it does uuids, tools and structured outputs): another salt
        finds no cached token in vLLM's prefix cache, the same salt's repeat does."""
        base = servers["qwen"].base
        c = client(base)
        text = "Answer as one who has read every page of the manual twice over. " * 3

        def cached(salt: str) -> int:
            reply = c.chat.completions.create(
                model=model_id(base), max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": text}, {"role": "user", "content": "?"}],
                extra_body={"cache_salt": salt})
            return reply.usage.prompt_tokens_details.cached_tokens

        assert cached("tenant-a") == 0 and cached("tenant-a") > 0 and cached("tenant-b") == 0


# vLLM's own server starts with ours when TestQwen25VL is in the session: the two start-ups
# overlap (each keeps about one of 2 cores busy for ~50 s)
served_pool.BESIDE[served_pool.Serve("vllm", served_pool.normalised(TOOLS_SERVER))] = (
    f"{Path(__file__).relative_to(Path(__file__).parents[2])}::TestQwen25VL",
    lambda: VllmServer(tiny_model("qwen2_5_vl")))


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in response.read().decode().splitlines()
                if line and not line.startswith("#")}


class TestLeftOutMedia:
    """Media vLLM's processor cache holds is left out, undecoded, and sent again when vLLM has
    evicted it (engine.server.vllm_adapter.vllm_media). The cache is small (--mm-processor-cache-gb
    0.0004, 429 KB, passed to vLLM and sizing the ledger): 16x16 images, which the processor
    scales up to its minimum of 56x56 (16 patches of 1,176 values), are counted at the
    ledger's floor of 16 KiB each and take vLLM 19-75 KB (uint8 or float32 patches), so after
    24 others the ledger (25 x 16 KiB = 410 KB) still holds the first and vLLM (over 475 KB)
    no longer does. Prefix caching is off, so every answer comes from the same prefill."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls):
        server = start_ours("qwen2_5_vl", "--mm-processor-cache-gb", "0.0004",
                            "--no-enable-prefix-caching")
        try:
            server.wait_ready(600)
            assert server.is_ready, server.output
            yield server
        finally:
            code = server.stop(timeout=60)
        # its stop drained, vLLM shut down once, nothing printed a traceback (AsyncLLM's
        # __del__ shutting it down again at the interpreter's exit did, on every stop)
        at = server.output.rfind("draining in-flight")
        stopped = server.output[at:]
        assert code == 0 and at >= 0 and "MPClient: complete" in stopped, \
            server.output[-3000:]
        assert "Traceback" not in stopped and "Exception ignored" not in stopped, stopped

    def test_a_held_image_is_left_out_and_an_evicted_one_sent_again(self, server):
        base = server.base

        def ask(seed: int) -> tuple[str, int, list, dict]:
            image = data_url(synthetic.make_image(16, 16, fmt="PNG", seed=seed), "image/png")
            body = json.dumps({"model": model_id(base), "max_tokens": 5, "temperature": 0,
                               "messages": chat({"type": "image_url",
                                                 "image_url": {"url": image}})}).encode()
            request = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=180) as response:
                timings = json.loads(response.headers["x-aphrodite-timings"])
                reply = json.loads(response.read())
            return (reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens"],
                    reply["aphrodite"]["cache_hits"], timings)

        def resent() -> float:
            return scrape(base).get("aphrodite_vllm_media_resent_total", 0.0)

        first = ask(100)
        assert first[2] == [False]  # never sent: decoded and sent with its data
        again = ask(100)
        assert again[2] == [True] and again[:2] == first[:2]  # left out, the same answer
        assert again[3]["media_decode_s"] < first[3]["media_decode_s"]
        assert resent() == 0  # vLLM held it
        for seed in range(101, 125):  # 24 others: vLLM evicts the first, the ledger not
            assert ask(seed)[2] == [False]
        evicted = ask(100)
        # left out, vLLM lacked it, sent again with its data: not a cache hit; same answer
        assert evicted[2] == [False] and evicted[:2] == first[:2]
        assert resent() == 1
        assert ask(100)[2] == [True] and resent() == 1  # held again since


class TestQwen2Audio:
    """Audio through ``serve --engine vllm`` (two API servers) on a tiny Qwen2-Audio, beside
    vLLM's own server on the same folder."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls):
        for ours, peer in server_pair("qwen2_audio", "--api-server-count", "2"):
            yield {"audio": ours, "audio-peer": peer}

    @pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
    def test_chat_with_audio(self, servers, stream):
        check_chat(servers["audio"], "audio", stream)

    @pytest.mark.parametrize("count", [1, 2])
    def test_prompt_tokens_equal_vllms_own_server(self, servers, count):
        check_prompt_tokens(servers["audio"], servers["audio-peer"], ("audio",) * count)

    def test_cache_resets_reach_vllm(self, servers):
        base = servers["audio"].base  # two API servers: the processor cache reset reaches both
        for route in ("reset_mm_cache", "reset_prefix_cache"):
            request = urllib.request.Request(f"{base}/{route}", b"", method="POST")
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = json.loads(response.read())
            assert answer["reset"] is True, answer
            if route == "reset_mm_cache":
                assert answer["api_servers"] == 2
        reply = client(base).chat.completions.create(model=model_id(base), max_tokens=2,
                                                     messages=chat(PARTS["audio"]))
        assert reply.choices[0].finish_reason == "length"


def test_tensor_parallel_2_on_vllm_cpu():
    """``--tensor-parallel-size 2`` through this server on vllm-cpu: two CPU workers, each
    pinned to one core (vLLM refuses to start them on a 2-core machine without the binding:
    "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). Its own server,
    started after the module's others stopped (it needs both cores), and the one vLLM start-up
    of the suite that keeps vLLM's default, its model compiled (the others: --enforce-eager)."""
    vllm_python()
    server = ServerProcess(str(tiny_model("qwen2_5_vl")), "--engine", "vllm", *COMMON, *VLLM_KV,
                           "--tensor-parallel-size", "2",
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        server.wait_ready(600)
        assert server.is_ready, server.output[-3000:]
        assert "world_size=2" in server.output
        assert "Enforce eager set" not in server.output  # (vLLM's line when it is)
        reply = client(server.base).chat.completions.create(
            model=model_id(server.base), messages=chat(PARTS["image"]), max_tokens=4)
        assert reply.choices[0].finish_reason == "length" and reply.usage.prompt_tokens > 20
    finally:
        server.stop(timeout=60)
