"""The `aphrodite` command, run as a user runs it: a real process."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import synthetic

BIN = Path(sys.executable).with_name("aphrodite")


def run(*args: str, stdin: str | None = None, env: dict | None = None):
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, input=stdin,
                          timeout=120, env=full_env)


def test_help_and_version_do_not_import_torch_or_transformers():
    code = (
        "import sys\nfrom aphrodite_cli.main import app\n"
        "for argv in (['--help'], ['--version'], ['media', '--help']):\n"
        "    try:\n        app(argv, standalone_mode=False)\n"
        "    except SystemExit:\n        pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'av', 'cv2', 'torchcodec') "
        "if m in sys.modules]\nprint('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_version():
    from engine.version import __version__

    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"aphrodite {__version__}"


def test_probe_accepts_a_local_image(tmp_path):
    (tmp_path / "a.png").write_bytes(synthetic.make_image(64, 48, fmt="PNG"))
    result = run("media", "probe", f"file://{tmp_path}/a.png",
                 "--allowed-local-media-path", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["mime"] == "image/png"
    assert report["sent_to_model"] == {"type": "image", "mode": "RGB", "width": 64, "height": 48}


def test_probe_refusal_exit_code_and_rule(tmp_path):
    result = run("media", "probe", "file:///etc/passwd", "--modality", "image",
                 "--allowed-local-media-path", str(tmp_path), "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "media_local_path_outside"
    human = run("media", "probe", "http://169.254.169.254/latest/x.png")
    assert human.returncode == 1
    assert "media_private_address" in human.stdout and "--allowed-media-domains" in human.stdout


def test_probe_reads_long_data_urls_from_stdin():
    wav = synthetic.make_audio(seconds=1.0)
    url = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    result = run("media", "probe", "-", "--json", stdin=url)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["sent_to_model"]["samples"] == 16000


def test_probe_video_reports_counted_frames(tmp_path):
    (tmp_path / "c.mp4").write_bytes(synthetic.make_video(width=64, height=48, seconds=0.5))
    result = run("media", "probe", f"file://{tmp_path}/c.mp4",
                 "--allowed-local-media-path", str(tmp_path), "--json")
    details = json.loads(result.stdout)["details"]
    assert details["codec"] == "h264" and details["counted_frames"] == 15


def test_bad_flag_value_is_a_usage_error(tmp_path):
    result = run("media", "probe", "file:///x.png", "--allowed-local-media-path",
                 str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_bad_env_var_is_one_line_error():
    result = run("media", "probe", "http://x/a.png",
                 env={"APHRODITE_IMAGE_FETCH_TIMEOUT": "soon"})
    assert result.returncode == 2
    assert "APHRODITE_IMAGE_FETCH_TIMEOUT" in result.stderr and "Traceback" not in result.stderr


def test_unknown_env_var_is_warned():
    result = run("media", "--help", env={"APHRODITE_VIDEO_BACKEND": "pyav"})
    assert result.returncode == 0
    assert "unknown environment variable APHRODITE_VIDEO_BACKEND" in result.stderr
    assert "APHRODITE_VIDEO_LOADER_BACKEND" in result.stderr


def test_generate_is_deterministic(tmp_path):
    for name in ("a.mp4", "b.mp4"):
        assert run("media", "generate", "video", str(tmp_path / name), "--seconds", "0.3",
                   "--width", "64", "--height", "48").returncode == 0
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()


@pytest.mark.parametrize("kind,name", [("image", "x.webp"), ("audio", "x.flac")])
def test_generate_then_probe(tmp_path, kind, name):
    assert run("media", "generate", kind, str(tmp_path / name)).returncode == 0
    result = run("media", "probe", f"file://{tmp_path}/{name}", "--json",
                 "--allowed-local-media-path", str(tmp_path))
    assert json.loads(result.stdout)["ok"]


def test_media_decode_writes_pngs_and_metadata(tmp_path):
    (tmp_path / "c.mp4").write_bytes(synthetic.make_video(width=64, height=48, seconds=1))
    out = tmp_path / "frames"
    result = run("media", "decode", f"file://{tmp_path}/c.mp4", "--allowed-local-media-path",
                 str(tmp_path), "--backend", "pyav", "--num-frames", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "decode.json").read_text())
    assert meta["sampled_indices"] == [0, 10, 19, 29] and meta["backend"] == "pyav"
    from PIL import Image

    frames = sorted(out.glob("frame_*.png"))
    assert len(frames) == 4
    assert synthetic.read_frame_index(__import__("numpy").asarray(Image.open(frames[2]))) == 19


def test_media_decode_refuses_a_wrong_option(tmp_path):
    (tmp_path / "c.mp4").write_bytes(synthetic.make_video(width=64, height=48, seconds=0.3))
    result = run("media", "decode", f"file://{tmp_path}/c.mp4", "--allowed-local-media-path",
                 str(tmp_path), "--backend", "opencv", "--options", '{"seek_mode": "exact"}',
                 "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "belongs to the torchcodec backend" in result.stderr
    # the same option in the one NAME:KEY=VALUE syntax the benchmarks take
    result = run("media", "decode", f"file://{tmp_path}/c.mp4", "--allowed-local-media-path",
                 str(tmp_path), "--backend", "opencv:seek_mode=exact", "--out",
                 str(tmp_path / "o"))
    assert result.returncode == 2 and "belongs to the torchcodec backend" in result.stderr
    ok = run("media", "decode", f"file://{tmp_path}/c.mp4", "--allowed-local-media-path",
             str(tmp_path), "--backend", "torchcodec:seek_mode=approximate", "--num-frames", "2",
             "--out", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "ok" / "decode.json").read_text())["backend"] == "torchcodec"


def test_bench_video_decode_writes_a_result(tmp_path):
    clip = tmp_path / "c.mp4"
    clip.write_bytes(synthetic.make_video(width=160, height=120, seconds=2, gop=20))
    result = run("bench", "video-decode", str(clip), "--backends", "pyav,opencv",
                 "--num-frames", "8", "--repeats", "2", "--out-dir", str(tmp_path / "res"))
    assert result.returncode == 0, result.stderr
    files = list((tmp_path / "res").glob("video-decode-*.json"))
    doc = json.loads(files[0].read_text())
    assert doc["schema_version"] == 1 and doc["environment"]["packages"]["av"]
    assert [b["identical_to_exact"] for b in doc["backends"]] == [True, True]
    assert all(len(b["times_s"]) == 2 for b in doc["backends"])
    assert len(doc["reference"]["times_s"]) == 2


def test_serve_flag_json_errors_show_the_bad_part():
    result = run("serve", "--limit-mm-per-prompt", '{"image": 2,, "video": 1}')
    assert result.returncode == 2
    assert "--limit-mm-per-prompt is not valid JSON" in result.stderr
    assert "near" in result.stderr and "Traceback" not in result.stderr
    result = run("serve", "--media-io-kwargs", '{"video": {"backend": "vlc"}}')
    assert result.returncode == 2 and "valid backends: opencv" in result.stderr


def test_serve_and_run_help_document_every_flag_with_examples():
    for command in ("serve", "run"):
        text = run(command, "--help", env={"COLUMNS": "250"}).stdout
        for flag in ("--host", "--port", "--served-model-name", "--chat-template", "--api-key",
                     "--allowed-media-domains", "--allowed-local-media-path",
                     "--limit-mm-per-prompt", "--mm-processor-kwargs", "--media-io-kwargs",
                     "--mm-processor-cache-gb", "--mm-ipc-gpu-memory-gb", "--api-server-count",
                     "--max-request-body-mb", "--max-num-seqs", "--max-num-batched-tokens",
                     "--num-threads", "--decode-threads", "--max-model-len",
                     "--enable-prefix-caching",
                     "--no-enable-prefix-caching", "--prefix-cache-gb", "--encoder-cache-gb",
                     "--block-size",
                     "--decode-isolation", "--decode-workers", "--decode-timeout-s",
                     "--decode-memory-gb", "--max-decode-queue", "--max-inflight-media-mb",
                     "--max-pending-requests"):
            assert flag in text, (command, flag)
        assert "Examples" in text


def test_bench_mm_processor_cold_warm_and_video_backends(tmp_path):
    result = run("bench", "mm-processor", "--num-prompts", "4", "--bucket-config",
                 '{"120,160,1": 0.5, "96,128,8": 0.5}', "--items-per-request", "2",
                 "--media-delivery", "http", "--video-backends", "pyav:threads=1,opencv",
                 "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(next(tmp_path.glob("mm-processor-*.json")).read_text())
    cold, warm = doc["phases"]["cold"], doc["phases"]["warm"]
    assert cold["hit_rate"] == 0.0 and warm["hit_rate"] == 1.0
    for stage in ("fetch_s", "hash_s", "cache_lookup_s", "media_decode_s", "processor_s",
                  "encoder_s"):
        assert {"mean", "median", "std", "p90", "p99"} <= set(cold["stages"][stage])
    assert cold["stages"]["encoder_s"]["median"] > 0 and doc["encoder"] is True
    assert warm["stages"]["media_decode_s"]["max"] == 0.0  # hits skip decoding
    assert [r["backend"] for r in doc["video_backends"]] == ["pyav", "opencv"]
    assert [r["options"] for r in doc["video_backends"]] == [{"threads": 1}, {}]
    assert all(r["decode_ms"]["count"] == 3 and r["frames_sampled"] == 16
               for r in doc["video_backends"])
    # which processor classes ran: in the result and in what it prints
    assert doc["source"]["processor"] == "Qwen2_5_VLProcessor"
    assert doc["source"]["image_processor"] == "Qwen2VLImageProcessor"
    assert ("processor: Qwen2_5_VLProcessor (image processor Qwen2VLImageProcessor, video "
            "processor Qwen2VLVideoProcessor)") in result.stdout


def test_bench_mm_processor_on_a_jsonl_dataset(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.jpg").write_bytes(synthetic.make_image(160, 120, seed=1))
    (tmp_path / "media" / "b.jpg").write_bytes(synthetic.make_image(160, 120, seed=2))
    rows = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"path": name}}, {"type": "text", "text": "Hi"}]}]}
        for name in ("a.jpg", "b.jpg")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = run("bench", "mm-processor", "--dataset-path", str(tmp_path / "d.jsonl"),
                 "--media-dir", str(tmp_path / "media"), "--num-prompts", "2", "--no-encoder",
                 "--out-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-1500:]
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert doc["dataset"]["name"] == "jsonl"
    assert doc["phases"]["cold"]["hit_rate"] == 0.0 and doc["phases"]["warm"]["hit_rate"] == 1.0


@pytest.mark.parametrize("source", ["", "file:///etc/passwd", "zz://a", "http://[]@/x.png",
                                    "data:,", "http://127.0.0.1./x.png", "\u3002",
                                    "data:image/png;base64,!!!", "-x"])
def test_media_probe_json_prints_json_for_every_input(source):
    """Scripts parse `media probe --json`: a refusal before any probing (no modality can be
    guessed, a malformed URL) still prints the report's shape, never a bare error line."""
    done = subprocess.run([str(BIN), "media", "probe", "--json", "--", source],
                          capture_output=True, text=True, timeout=60)
    doc = json.loads(done.stdout)
    assert doc["ok"] is False and done.returncode in (1, 2)
    assert set(doc["error"]) >= {"status", "code", "message", "hint"}


def test_a_bad_flag_is_reported_before_the_port_is_bound():
    """A flag error is exit 2 naming the flag even when the port is taken (the port is bound
    only once the flags are known good)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        result = run("serve", "--port", port, "--media-io-kwargs",
                     '{"video": {"backend": "vlc"}}')
        assert result.returncode == 2 and "valid backends: opencv" in result.stderr
        result = run("serve", "--port", port)
        assert result.returncode == 1 and "already in use" in result.stderr


def _commands(group, prefix=()):
    """Every command path of a click group, depth first."""
    for name, command in sorted(group.commands.items()):
        if getattr(command, "commands", None):  # a group (typer vendors its own click)
            if getattr(command, "invoke_without_command", False):  # a command itself too
                yield (*prefix, name)
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name)


def test_every_commands_help_survives_a_pipe():
    """Piped into a file or a CI log (not a terminal), no flag name or help text is cut with
    "…", and completion can be installed."""
    import typer

    from aphrodite_cli.main import app

    paths = list(_commands(typer.main.get_command(app)))
    assert ("bench", "sweep") in paths and ("bench", "sweep", "serve") in paths
    assert ("model", "download") in paths and len(paths) >= 15
    exe = Path(sys.executable).with_name("aphrodite")
    for path in paths:
        done = subprocess.run([str(exe), *path, "--help"], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "TERMINAL_WIDTH": ""})
        assert done.returncode == 0, (path, done.stderr[-500:])
        assert "…" not in done.stdout, (path, [ln for ln in done.stdout.splitlines()
                                               if "…" in ln][:3])
        # a flag takes no value: none is shown for it (Typer's default writes "<bool>")
        assert "<bool>" not in done.stdout, (path, [ln for ln in done.stdout.splitlines()
                                                    if "<bool>" in ln][:3])
    # as a user runs it, from a shell: Typer names the shell of its parent process (the
    # builtin after it keeps bash from exec-ing the command in its own place)
    done = subprocess.run(["bash", "-c", '"$0" --show-completion; exit $?', str(exe)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "_aphrodite_completion" in done.stdout


def test_bench_mm_processor_compare_models_side_by_side(tmp_path):
    """Two families' processors on the same media in one result and one table: tokens per
    image and video differ as their processor configs make them, each names its classes."""
    result = run("bench", "mm-processor", "--compare-models", "tiny:qwen2_5_vl,tiny:qwen3_vl",
                 "--num-prompts", "2", "--no-encoder", "--mode", "cold", "--bucket-config",
                 '{"240,320,1": 0.5, "96,128,4": 0.5}', "--seed", "3", "--output-format",
                 "markdown", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(next(tmp_path.glob("mm-processor-compare-*.json")).read_text())
    assert doc["models"] == ["tiny:qwen2_5_vl", "tiny:qwen3_vl"]
    first, second = doc["results"]
    assert (first["source"]["processor"], second["source"]["processor"]) == (
        "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
    assert first["dataset"] == second["dataset"]  # the same media for both
    assert sum(r["tokens_per_item"]["image"]["count"] + r["tokens_per_item"].get(
        "video", {"count": 0})["count"] for r in (first, second)) == 2 * 2
    assert "| tiny:qwen2_5_vl | Qwen2VLImageProcessor |" in result.stdout
    assert "| tiny:qwen3_vl |" in result.stdout
    bad = run("bench", "mm-processor", "--compare-models", "tiny:qwen2_5_vl")
    assert bad.returncode == 2 and "--compare-models" in bad.stderr
