"""Server processes and the other families: LLaVA with --chat-template, Qwen2-Audio, two API
servers on one port, drain on SIGTERM, crash detection."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine.models.templates_path import template_path
from tests.fixtures import MediaHost, synthetic
from tests.server_harness import BIN, ServerProcess, free_port, wait_exit

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def media():
    cat = synthetic.make_image(160, 120, fmt="JPEG", seed=5)
    server = MediaHost({
        "/cat.jpg": (cat, "image/jpeg"),
        "/slow-cat.jpg": (cat, "image/jpeg"),
        "/tone.wav": (synthetic.make_audio(seconds=1.0), "audio/wav"),
        "/clip.mp4": (synthetic.make_video(width=96, height=64, fps=8, seconds=2), "video/mp4"),
    }, delays={"/slow-cat.jpg": 4.0})
    yield server
    server.stop()


def test_llava_without_a_chat_template_refuses_to_start():
    done = subprocess.run([str(BIN), "serve", "tiny:llava", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2
    assert "--chat-template" in done.stderr and "Traceback" not in done.stderr


def test_llava_with_the_shipped_template(media):
    server = ServerProcess("tiny:llava", "--chat-template", str(template_path("llava")),
                           "--allowed-media-domains", "127.0.0.1",
                           "--max-pending-requests", "1").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny:llava", max_tokens=3, temperature=0, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"{media.base}/cat.jpg"}},
                {"type": "text", "text": "What is this?"}]}], extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as info:  # LLaVA-1.5: one image per prompt
            client.chat.completions.create(model="tiny:llava", max_tokens=3, messages=[{
                "role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": f"{media.base}/cat.jpg"}}] * 2}])
        assert "model's own maximum is 1" in info.value.body["message"]
        # Overload: one request in flight is the limit; a second one is answered at once.
        # The first waits on a slow media host (4 s), so it is surely still in flight.
        long = threading.Thread(target=lambda: client.chat.completions.create(
            model="tiny:llava", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"{media.base}/slow-cat.jpg"}}]}]))
        long.start()
        import time

        deadline = time.monotonic() + 10
        while media.hits["/slow-cat.jpg"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        raw = urllib.request.Request(f"{server.base}/v1/chat/completions", data=json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(raw, timeout=30)
        assert busy.value.code == 503 and busy.value.headers["Retry-After"] == "1"
        assert json.loads(busy.value.read())["error"]["code"] == "server_overloaded"
        long.join(120)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava_onevision", "internvl"])
def test_image_and_video_families_over_http(media, arch):
    """Served: an image and a fetched video in one chat through the openai client; the prompt
    the model gets is as long as one Hugging Face processor call on the chat makes it from the
    decoded media, and again from the cache. Qwen3-VL writes each temporal patch's time into
    the prompt from the clip's own metadata (text tokens); LLaVA-OneVision tiles its images
    (anyres) and InternVL3 takes up to 12 tiles and a thumbnail."""
    from engine.config import MediaLimits
    from engine.media.image import decode_image
    from engine.media.video.options import server_video_spec
    from engine.processing.media_items import InProcessDecoders, hf_video_metadata
    from tests.engine_fixtures import loaded

    video_io = {"video": {"backend": "pyav", "num_frames": 4}}
    server = ServerProcess(f"tiny:{arch}", "--allowed-media-domains", "127.0.0.1",
                           "--media-io-kwargs", json.dumps(video_io)).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": f"{media.base}/cat.jpg"}},
                   {"type": "video_url", "video_url": {"url": f"{media.base}/clip.mp4"}},
                   {"type": "text", "text": "What happens?"}]
        replies = [client.chat.completions.create(
            model=f"tiny:{arch}", max_tokens=3, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": content}]) for _ in range(2)]
    finally:
        assert server.stop() == 0
    limits = MediaLimits.from_env()
    video = InProcessDecoders().decode_video(media.files["/clip.mp4"][0],
                                           server_video_spec(video_io), limits)
    processor = loaded(arch).processor
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        tokenize=False, add_generation_prompt=True)
    extra = {"video_metadata": [hf_video_metadata(video.metadata)],
             "do_sample_frames": False} if arch == "qwen3_vl" else {}
    ref = processor(text=[text], images=[decode_image(media.files["/cat.jpg"][0], limits)],
                    videos=[video.frames], **extra)
    assert [r.usage.prompt_tokens for r in replies] == [len(ref["input_ids"][0])] * 2
    assert replies[0].usage.completion_tokens == 3
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_smolvlm_image_or_video_over_http_and_both_refused_before_any_fetch(media):
    """SmolVLM served: a fetched image (split into tiles) and, in another request, a fetched
    video (timestamped frames from the clip's own metadata), each with the prompt length one
    Hugging Face processor call makes; a chat with both is a 400 naming the rule, and nothing
    was fetched for it."""
    from engine.config import MediaLimits
    from engine.media.image import decode_image
    from engine.media.video.options import server_video_spec
    from engine.processing.media_items import InProcessDecoders, hf_video_metadata
    from tests.engine_fixtures import loaded

    video_io = {"video": {"backend": "pyav", "num_frames": 4}}
    server = ServerProcess("tiny:smolvlm", "--allowed-media-domains", "127.0.0.1",
                           "--media-io-kwargs", json.dumps(video_io)).wait_ready()
    image = {"type": "image_url", "image_url": {"url": f"{media.base}/cat.jpg"}}
    video = {"type": "video_url", "video_url": {"url": f"{media.base}/clip.mp4"}}
    question = {"type": "text", "text": "What happens?"}
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)

        def ask(*parts):
            return client.chat.completions.create(
                model="tiny:smolvlm", max_tokens=3, temperature=0,
                messages=[{"role": "user", "content": [*parts, question]}])

        got = {"image": ask(image).usage.prompt_tokens, "video": ask(video).usage.prompt_tokens}
        before = dict(media.hits)
        with pytest.raises(openai.BadRequestError) as info:
            ask(image, video)
        assert info.value.body["code"] == "mixed_modalities_unsupported"
        assert "not both" in info.value.body["message"]
        assert dict(media.hits) == before  # refused before anything was fetched
    finally:
        assert server.stop() == 0
    limits = MediaLimits.from_env()
    clip = InProcessDecoders().decode_video(media.files["/clip.mp4"][0],
                                          server_video_spec(video_io), limits)
    processor = loaded("smolvlm").processor

    def chat(part: str) -> str:
        return processor.apply_chat_template([{"role": "user", "content": [
            {"type": part}, question]}], tokenize=False, add_generation_prompt=True)

    ref_image = processor(text=[chat("image")], add_special_tokens=False, return_tensors="pt",
                          images=[[decode_image(media.files["/cat.jpg"][0], limits)]])
    ref_video = processor(text=[chat("video")], add_special_tokens=False, videos=[clip.frames],
                          video_metadata=[hf_video_metadata(clip.metadata)],
                          do_sample_frames=False, return_tensors="pt")
    assert got == {"image": len(ref_image["input_ids"][0]),
                   "video": len(ref_video["input_ids"][0])}


def test_gemma3_image_with_pan_and_scan_over_http(media):
    """Gemma 3 served with pan-and-scan on (--mm-processor-kwargs): a fetched image in a chat
    through the openai client gets its crops; the prompt is as long as one Hugging Face
    processor call on the chat with the same kwargs makes it (one <bos>: its template writes
    it, as apply_chat_template(tokenize=True) tokenizes), and again from the cache."""
    from engine.config import MediaLimits
    from engine.media.image import decode_image
    from tests.engine_fixtures import loaded

    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
    server = ServerProcess("tiny:gemma3", "--allowed-media-domains", "127.0.0.1",
                           "--mm-processor-kwargs", json.dumps(kwargs)).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": f"{media.base}/cat.jpg"}},
                   {"type": "text", "text": "What is it?"}]
        replies = [client.chat.completions.create(
            model="tiny:gemma3", max_tokens=3, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": content}]) for _ in range(2)]
    finally:
        assert server.stop() == 0
    processor = loaded("gemma3").processor
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}], tokenize=False,
        add_generation_prompt=True)
    ref = processor(text=[text], images=[decode_image(media.files["/cat.jpg"][0],
                                                      MediaLimits.from_env())],
                    add_special_tokens=False, **kwargs)
    soft = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert list(ref["input_ids"][0]).count(soft) == 3 * 16  # the image and its two crops
    assert [r.usage.prompt_tokens for r in replies] == [len(ref["input_ids"][0])] * 2
    assert replies[0].usage.completion_tokens == 3
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_qwen2_audio_parts_and_private_addresses_and_drain(media):
    """No --allowed-media-domains: loopback media is a private address and is refused."""
    server = ServerProcess("tiny:qwen2_audio").wait_ready()
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
    try:
        before = media.total
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny:qwen2_audio", max_tokens=2, messages=[{
                "role": "user", "content": [{"type": "audio_url", "audio_url": {
                    "url": f"{media.base}/tone.wav"}}]}])
        assert info.value.body["code"] == "media_private_address" and media.total == before
        wav = base64.b64encode(synthetic.make_audio(seconds=0.5)).decode()
        reply = client.chat.completions.create(
            model="tiny:qwen2_audio", max_tokens=3, temperature=0, messages=[{
                "role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                    {"type": "text", "text": "What is it?"}]}], extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        # Drain: a long stream in flight when SIGTERM arrives still completes.
        got: dict[str, object] = {}
        first_token = threading.Event()

        def stream() -> None:
            chunks = client.chat.completions.create(
                model="tiny:qwen2_audio", max_tokens=300, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "Tell me everything."}])
            n = 0
            for c in chunks:
                if c.choices and c.choices[0].delta.content is not None:
                    n += 1
                    first_token.set()
            got["n"] = n

        worker = threading.Thread(target=stream)
        worker.start()
        assert first_token.wait(120)  # the stream is surely in flight when SIGTERM arrives
        server.proc.send_signal(signal.SIGTERM)
        # New connections are refused while the server drains (nobody listens any more),
        # instead of waiting in a backlog that nobody accepts until they are reset at exit.
        refused = False
        while server.proc.poll() is None and not refused:
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                time.sleep(0.02)
            except ConnectionRefusedError:
                refused = True
            except OSError:
                time.sleep(0.02)
        assert refused, "the port still took connections while the server drained"
        worker.join(120)
        assert got.get("n", 0) >= 250  # every token arrived, none was cut off
        assert wait_exit(server.proc, 60) == 0
        assert "draining" in server.output
        assert not server.process_file.exists()  # --process-file: removed at exit
    finally:
        server.stop()


def test_two_api_servers_share_the_port_and_crashes_are_reported():
    """The ready line comes only once both API servers listen; both accept from the one
    listening socket the supervisor bound, so both answer, and /metrics on either one counts
    the requests both served. The start-up lines name the engine's thread settings."""
    server = ServerProcess("tiny:qwen2_vl", "--api-server-count", "2", "--num-threads", "2",
                           "--decode-threads", "1").wait_ready()
    try:
        assert "engine: torch threads 2 (--num-threads), 1 in decode steps (--decode-threads);" \
            " prefills beside decode steps off (--overlap-prefill;" in server.output
        def one(i: int) -> str:
            # ignore_eos: exactly 2 tokens each (a sampled EOS would end one at 1)
            body = json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"}],
                               "max_tokens": 2, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{server.base}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json",
                                                  "Connection": "close"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
                return resp.headers["x-aphrodite-api-server"]

        # --process-file: every process by role, the same ones the process group holds
        published = server.processes()
        api_pids = {str(p) for p in published["api_servers"]}
        assert len(api_pids) == 2 and len(published["engines"]) == 1
        assert published["supervisor"] == server.proc.pid
        assert {published["supervisor"], *published["engines"], *published["api_servers"]} \
            <= set(server.group_members())
        seen: set[str] = set()
        sent = 0
        with ThreadPoolExecutor(8) as pool:
            # 8 connections at once keep both processes accepting; stop as soon as both
            # answered.
            for _ in range(8):
                seen |= set(pool.map(one, range(8)))
                sent += 8
                if seen == api_pids:
                    break
        assert seen == api_pids  # both API server processes answered, and only they
        # Whichever process takes a scrape reports the server's totals, not its own share.
        # Both processes accept from the one listening socket: whichever is idle first takes
        # a connection, so scrapes go out 8 at a time (one at a time, the process that
        # answered last can win every accept on a loaded machine).
        def scrape(_: int) -> str:
            req = urllib.request.Request(f"{server.base}/metrics",
                                         headers={"Connection": "close"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read().decode()
                who = resp.headers["x-aphrodite-api-server"]
            ok = re.search(r'^aphrodite_requests_total\{route="/v1/chat/completions",'
                           r'status="200"\} (\S+)$', text, re.M)
            assert ok and float(ok.group(1)) == sent, (ok and ok.group(0), sent)
            tokens = re.search(r'^vllm:generation_tokens_total\{model_name="tiny:qwen2_vl"\} '
                               r'(\S+)$', text, re.M)
            assert tokens and float(tokens.group(1)) == 2 * sent
            assert re.search(r'^vllm:num_requests_running\{model_name="tiny:qwen2_vl"\} 0\.0$',
                             text, re.M)
            return who

        scraped: set[str] = set()
        with ThreadPoolExecutor(8) as pool:
            for _ in range(16):
                scraped |= set(pool.map(scrape, range(8)))
                if scraped == api_pids:
                    break
        assert scraped == api_pids
        engine_pid = server.pid_of("engine")
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_exit(server.proc, 60) == 1
        assert "engine process exited unexpectedly" in server.output
        # The supervisor stopped every other child itself (the resource tracker exits a moment
        # after the last process holding its pipe: 10 s is slack).
        assert server.kill_group(grace=10) == []
    finally:
        server.stop(signal.SIGKILL)


def test_children_stop_when_the_supervisor_is_killed_outright():
    """SIGKILL gives the supervisor no chance to stop its children: the fork server that
    started them exits with it, the kernel tells them (parent-death signal) and the engine,
    both API servers, their decode workers and the resource tracker all exit on their own,
    freeing the port; the last API server out
    removes the folder they shared their metrics in."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("aphrodite-metrics-*"))
    server = ServerProcess("tiny:qwen2_vl", "--api-server-count", "2").wait_ready()
    try:
        shared = set(tmp.glob("aphrodite-metrics-*")) - before
        assert len(shared) == 1 and any(next(iter(shared)).glob("counter_*.db"))
        assert len(server.group_members()) >= 4  # supervisor, engine, 2 API servers, ...
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + 60  # a drain with nothing in flight takes ~1 s
        while server.group_members() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = server.group_members()
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
        with socket.socket() as probe:  # nobody listens on the port any more
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            probe.bind(("127.0.0.1", server.port))
            probe.listen()
        assert not next(iter(shared)).exists()
    finally:
        server.stop(signal.SIGKILL)


def test_gpu_decode_budget_is_split_among_api_servers(media):
    """deepstream counts as a GPU backend (it runs its software path here): its decodes hold
    the per-process budget; a video bigger than one share is a 413 naming the flag."""
    clip = synthetic.make_video(width=128, height=96, seconds=1)
    server = ServerProcess("tiny:qwen2_vl", "--api-server-count", "2",
                           "--media-io-kwargs", '{"video": {"backend": "deepstream", '
                           '"num_frames": 4}}', "--mm-ipc-gpu-memory-gb", "0.0003").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
        url = "data:video/mp4;base64," + base64.b64encode(clip).decode()

        def ask(frames: int):
            return client.chat.completions.create(
                model="tiny:qwen2_vl", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": url}}]}],
                extra_body={"ignore_eos": True,
                            "media_io_kwargs": {"video": {"num_frames": frames}}})

        # share = 0.0003 GiB / 2 = 161061 bytes; 4 frames of 128x96 RGB = 147456 bytes fit
        assert ask(4).usage.completion_tokens == 2
        with pytest.raises(openai.APIStatusError) as info:
            ask(8)  # 294912 bytes: more than one API server's share
        assert info.value.status_code == 413
        assert "--mm-ipc-gpu-memory-gb" in info.value.body["message"]
        with urllib.request.urlopen(f"{server.base}/metrics") as resp:
            assert "aphrodite_gpu_decode_budget_bytes_in_use 0.0" in resp.read().decode()
    finally:
        assert server.stop() == 0


def _decode_worker_pids(api_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(api_pid)], capture_output=True, text=True).stdout
    pids = []
    for pid in (int(p) for p in out.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def test_decode_isolation_survives_a_killed_decoder():
    server = ServerProcess("tiny:qwen2_vl", "--decode-isolation", "process",
                           "--decode-workers", "1", "--mm-processor-cache-gb", "0").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)

        def ask(clip: bytes, frames: int = 4):
            url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
            return client.chat.completions.create(
                model="tiny:qwen2_vl", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": url}}]}],
                extra_body={"ignore_eos": True,
                            "media_io_kwargs": {"video": {"backend": "pyav", "skip_nonref": False,
                                                          "num_frames": frames}}})

        small = synthetic.make_video(width=96, height=64, seconds=1)
        assert ask(small).usage.completion_tokens == 2
        api_pid = server.pid_of("API server")
        workers = _decode_worker_pids(api_pid)
        assert len(workers) == 1
        big = synthetic.make_video(width=1920, height=1080, seconds=4)
        result: dict[str, object] = {}

        def victim() -> None:
            try:
                ask(big, frames=32)  # the most a request may ask for (the default)
                result["status"] = 200
            except openai.APIStatusError as err:
                result["status"], result["code"] = err.status_code, err.body["code"]

        def cpu_ticks(pid: int) -> int:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        before = cpu_ticks(workers[0])
        thread = threading.Thread(target=victim)
        thread.start()
        import time

        deadline = time.monotonic() + 60
        while cpu_ticks(workers[0]) < before + 5 and time.monotonic() < deadline:
            time.sleep(0.005)  # wait until the worker is busy decoding the big clip
        os.kill(workers[0], signal.SIGKILL)
        thread.join(120)
        assert result == {"status": 422, "code": "media_decoder_crashed"}
        assert ask(small).usage.completion_tokens == 2  # a replacement worker decodes it
        replacement = _decode_worker_pids(api_pid)
        assert len(replacement) == 1 and replacement != workers
        assert server.proc.poll() is None
    finally:
        assert server.stop() == 0


def test_a_port_in_use_is_one_line_and_exit_1(served):
    """The supervisor binds the port before anything loads: a second server on a port that
    another holds (an aphrodite server, here the suite's plain one, or anything else) stops
    at once, never shares it."""
    first = served
    done = subprocess.run([str(BIN), "serve", "tiny:qwen2_vl", "--port", str(first.port)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {first.port} on 127.0.0.1 is already in use" in done.stderr
    assert "--port" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 2  # the error and its hint
    with urllib.request.urlopen(f"{first.base}/health", timeout=30) as resp:
        assert resp.status == 200  # the first server is untouched (served checks its exit)
    with socket.socket() as holder:  # a port held by something that is not aphrodite
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([str(BIN), "serve", "--port", str(port)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and f"port {port}" in done.stderr


def test_an_engine_that_dies_at_start_up_is_a_start_up_error_exit_1(tmp_path):
    """Weights that do not load kill the engine process while it starts: the server stops
    with a start-up error (exit 1, the engine's own message above it), not a configuration
    error (exit 2: that is for a flag or setting the user can change)."""
    from engine.models.loader import tiny_model_dir

    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("qwen2_vl"), model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    done = subprocess.run([str(BIN), "serve", str(model), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the engine process exited during startup (code 1)" in done.stderr, done.stderr
    assert "see the messages above" in done.stderr


def _api_server_that_exits(*_args: object) -> None:
    """An API server process that dies at once (module-level: a spawned process finds it)."""
    raise SystemExit(3)


def test_an_api_server_that_dies_while_the_engine_loads_is_a_start_up_error(monkeypatch):
    """The API servers start beside the engine (they load while it does): one that exits
    stops the start-up with an error naming it, and no process of the server is left."""
    import multiprocessing

    from engine.errors import StartupError
    from engine.server import launcher
    from engine.server.config import ServerConfig

    monkeypatch.setattr(launcher, "api_server_main", _api_server_that_exits)
    announced: list[str] = []
    with pytest.raises(StartupError) as info:
        launcher.run(ServerConfig(model="tiny:qwen2_5_vl", port=free_port()),
                     announce=announced.append)
    assert "API server 0 exited during startup (code 3)" in info.value.message
    assert not any("serving" in line for line in announced)
    assert multiprocessing.active_children() == []  # the engine stopped with it


def test_a_stream_cut_by_an_engine_failure_ends_with_an_error_event():
    """After the headers, a failure is one SSE event in the OpenAI error shape and
    `data: [DONE]`: never a second HTTP response written into the chunked body."""
    import http.client

    server = ServerProcess("tiny:qwen2_vl").wait_ready()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
            "max_tokens": 4000, "ignore_eos": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: {")  # tokens are flowing
        os.kill(server.pid_of("engine"), signal.SIGKILL)
        rest = resp.read()  # the chunked body, to its end
        events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable", error
        assert set(error) == {"message", "type", "param", "code"}
        assert b"HTTP/1.1" not in rest
        conn.close()
    finally:
        server.stop(signal.SIGKILL)


def test_an_inherited_prometheus_multiproc_dir_does_not_change_one_api_server(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR left in the environment (vLLM and gunicorn deployments set
    it) is not this server's: one API server keeps its plain registry (before: it failed to
    start on a missing folder, or merged other programs' files into its numbers)."""
    server = ServerProcess("tiny:qwen2_vl", env={
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "no-such-folder")}).wait_ready()
    try:
        with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        assert "process_resident_memory_bytes" in text  # the single-process collectors
        assert not (tmp_path / "no-such-folder").exists()
    finally:
        assert server.stop() == 0


def _what_a_child_finds() -> tuple[bool, int | None]:
    """(torch imported before this ran, the fork server's alive pipe after exit_with_parent:
    None once let go) in a child of the fork server (module-level: the child finds it)."""
    import sys
    from multiprocessing import forkserver

    from engine.lifetime import exit_with_parent

    imported = "torch" in sys.modules
    exit_with_parent()
    return imported, forkserver._forkserver._forkserver_alive_fd


def test_the_fork_server_hands_children_torch_imported_and_leaves_nothing(tmp_path):
    """The supervisor's children start from a fork server that imported torch (what took a
    spawned child 5-6 s of each start-up); a child that asks for the parent-death signal lets
    go of the pipe that keeps the fork server alive (so it exits with the supervisor); once
    every child started its socket is removed, and the fork server is stopped on the way
    out; a child the process had before is not its to stop."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from engine.server.fork_server import fork_server, started_all

    earlier = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    earlier.start()
    with fork_server(tmp_path) as ctx:
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            imported, alive_fd = pool.submit(_what_a_child_finds).result(timeout=120)
        assert imported and alive_fd is None
        assert [p.name.startswith("listener-") for p in tmp_path.iterdir()] == [True]
        from multiprocessing import forkserver

        server_pid = forkserver._forkserver._forkserver_pid
        assert server_pid is not None and Path(f"/proc/{server_pid}").exists()
        started_all(tmp_path)
        assert list(tmp_path.iterdir()) == []
    assert forkserver._forkserver._forkserver_pid is None
    assert not Path(f"/proc/{server_pid}").exists()
    assert earlier.is_alive()
    earlier.terminate()
    earlier.join(10)


def _forked_by_the_fork_server(server: ServerProcess) -> bool:
    """Whether a process the server's fork server forked is running (the start-up check
    first, then the engine and the API servers)."""
    from tests.server_harness import process_table

    rows = [row for row in process_table() if row.pgid == server.pgid and row.state != "Z"]
    fork_servers = {row.pid for row in rows if row.ppid == server.proc.pid
                    and b"forkserver" in _cmdline(row.pid)}
    return any(row.ppid in fork_servers for row in rows)


def _fork_server_has_torchvision(server: ServerProcess) -> bool:
    """Whether the server's fork server has loaded torchvision's library (its preload under
    way: transformers, all Python, still to come, about a second here)."""
    from tests.server_harness import process_table

    for row in process_table():
        if row.ppid == server.proc.pid and b"forkserver" in _cmdline(row.pid):
            try:
                return "torchvision" in Path(f"/proc/{row.pid}/maps").read_text()
            except OSError:
                return False
    return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize(("moment", "sig", "to"), [
    ("the fork server imports", signal.SIGTERM, "supervisor"),
    ("the start-up check runs", signal.SIGINT, "supervisor"),
    # (a Ctrl-C in a terminal: the whole foreground group, the fork server in its imports too)
    ("the fork server imports transformers", signal.SIGINT, "group")])
def test_a_stop_during_start_up_stops_there_and_leaves_nothing(moment, sig, to):
    """SIGTERM or SIGINT before the server is ready (a deploy rolled back, a Ctrl-C): the
    start-up stops where it is, the supervisor stops what it started and removes its folder,
    one line and exit 0. (Before, SIGTERM ended the supervisor at once and left its fork
    server and resource tracker running, their socket folder and five named semaphores
    behind; SIGINT deadlocked it: the fork server waited for the start-up check, the check
    for the supervisor, the supervisor for the fork server.)"""
    tmp = Path(tempfile.gettempdir())
    folders_before = set(tmp.glob("aphrodite-*"))
    server = ServerProcess("tiny:qwen2_5_vl")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                len(server.group_members()) >= 3 if moment == "the fork server imports"
                else _fork_server_has_torchvision(server)
                if moment == "the fork server imports transformers"
                else _forked_by_the_fork_server(server)):
            time.sleep(0.02)
        assert server.proc.poll() is None and not server.is_ready, server.output
        if to == "group":
            os.killpg(server.pgid, sig)
        else:
            server.proc.send_signal(sig)
        code = server.proc.wait(60)
        deadline = time.monotonic() + 15  # (what it stopped is gone before it exits)
        while server.group_members() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [_cmdline(pid)[:120] for pid in server.group_members()]
        server._reader.join(5)
        assert code == 0, server.output
        assert f"stopped during start-up ({signal.Signals(sig).name})" in server.output
        assert "Traceback" not in server.output and "serving" not in server.output
        assert left == []
        assert set(tmp.glob("aphrodite-*")) - folders_before == set()
    finally:
        server.stop(signal.SIGKILL)
