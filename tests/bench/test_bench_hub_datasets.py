"""Public datasets by name (``bench serve --dataset-name hf|sharegpt``): rows of the known
multimodal schemas mapped to chat requests (model-free), and the command reading small
parquet files in the real schemas from a loopback fake Hub (tests/fake_hub.py) through the
real ``datasets`` library, the requests arriving at a recording target."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aphrodite_cli.bench.load.hub_schemas import find_schema, to_request, unknown_schema
from engine.errors import ConfigError
from tests.fake_hub import FakeHub
from tests.fixtures import synthetic

EXE = Path(sys.executable).with_name("aphrodite")


def _parts(request) -> list[dict]:
    [message] = request.messages
    return message["content"]


def _data(url: str) -> tuple[str, bytes]:
    head, _, payload = url.partition(";base64,")
    return head.removeprefix("data:"), base64.b64decode(payload)


def test_each_known_schema_maps_its_columns_to_one_chat_request(tmp_path):
    jpeg = synthetic.make_image(32, 24, fmt="JPEG", seed=1)
    png = synthetic.make_image(16, 16, fmt="PNG", seed=2)
    arena = {"question_id": "q", "images": [{"bytes": jpeg, "path": None}, {"bytes": png}],
             "conversation": [[{"role": "user", "content": "What is shown?"},
                               {"role": "assistant", "content": "A cat."}]]}
    req = to_request(arena, find_schema(list(arena)), "r", output_len=7)
    image, text = _parts(req)
    assert _data(image["image_url"]["url"]) == ("image/jpeg", jpeg)  # the first image only
    assert text == {"type": "text", "text": "What is shown?"} and req.output_len == 7

    mmvu = {"id": 1, "question": "Which way?", "choices": {"A": "left", "B": "right"},
            "video": "http://127.0.0.1:9/clip.mp4", "question_type": "multiple-choice"}
    video, text = _parts(to_request(mmvu, find_schema(list(mmvu)), "r", output_len=1))
    assert video == {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/clip.mp4"}}
    assert text["text"] == "Which way? A.left B.right"

    mmmu = {"id": "x", "question": "<image 1> vs <image 2>?", "options": "['one', 'two']",
            "image_1": {"bytes": png, "path": "a.png"}, "image_2": jpeg, "image_3": None,
            "answer": "A"}
    first, second, text = _parts(to_request(mmmu, find_schema(list(mmmu)), "r",
                                            output_len=1))
    assert _data(first["image_url"]["url"]) == ("image/png", png)
    assert _data(second["image_url"]["url"]) == ("image/jpeg", jpeg)
    assert text["text"] == "<image 1> vs <image 2>? A. one B. two"

    (tmp_path / "coco").mkdir()
    (tmp_path / "coco" / "1.jpg").write_bytes(jpeg)
    llava = {"id": "1", "image": "coco/1.jpg",
             "conversations": [{"from": "human", "value": "<image>\nDescribe it."},
                               {"from": "gpt", "value": "A cat."}]}
    image, text = _parts(to_request(llava, find_schema(list(llava)), "r", output_len=1,
                                    media_dir=tmp_path))
    assert _data(image["image_url"]["url"]) == ("image/jpeg", jpeg)
    assert text["text"] == "Describe it."


@pytest.mark.parametrize(("row", "says"), [
    ({"conversations": [{"from": "human", "value": "<image>hi"}], "image": "../x.jpg"},
     "outside --media-dir"),
    ({"conversations": [{"from": "human", "value": "hi"}], "image": "x.jpg"},
     "pass --media-dir"),
    ({"conversations": [{"from": "human", "value": 5}]}, "value is not a non-empty string"),
    ({"conversations": "hi"}, "conversations is not a non-empty list"),
    ({"conversation": [], "images": []}, "has no conversation/0/0/content"),
    ({"question": "q", "options": "[1, 2", "image_1": b"x"}, "options is not a list"),
    ({"question": "q", "choices": None, "video": 7}, "video is not bytes"),
])
def test_a_row_that_does_not_fit_its_schema_is_a_one_line_error_naming_it(row, says,
                                                                          tmp_path):
    with pytest.raises(ConfigError) as info:
        to_request(row, find_schema(list(row)), "ds row 3", output_len=1,
                   media_dir=None if "pass" in says else tmp_path)
    message = info.value.message
    assert says in message and "ds row 3" in message and "\n" not in message


def test_without_the_datasets_library_hf_is_a_one_line_error(monkeypatch):
    from aphrodite_cli.bench.load.hub_datasets import HubArgs, load_named

    monkeypatch.setitem(sys.modules, "datasets", None)  # the import fails
    with pytest.raises(ConfigError, match="datasets library, which is not installed"):
        load_named("hf", "acme/none", HubArgs(), num_prompts=1, output_len=1)


def test_an_unknown_schema_names_the_columns_it_has():
    assert find_schema(["prompt", "completion"]) is None
    error = unknown_schema("acme/text", ["prompt", "completion"])
    assert "(prompt, completion)" in error.message and "\n" not in error.message
    assert "VisionArena-Chat" in error.hint and error.code == "invalid_dataset"


def _parquet(folder: Path, rows: dict, features=None) -> Path:
    """``rows`` written as the Hub stores a dataset: data/train-00000-of-00001.parquet."""
    import datasets

    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        str(folder / "data" / "train-00000-of-00001.parquet"))
    return folder


def _bench(hub: FakeHub, home: Path, port: int, *args: str) -> subprocess.CompletedProcess:
    env = {**hub.client_env(home), "HF_DATASETS_CACHE": str(home / "datasets")}
    return subprocess.run(
        [str(EXE), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--mode",
         "cold", "--num-warmups", "0", "--out-dir", str(home / "out"), "--result-filename",
         "hub.json", *args], capture_output=True, text=True, timeout=180, env=env)


def test_hub_datasets_by_name_reach_the_target_through_a_fake_hub(
        recording_mock, media_server, tmp_path):
    """VisionArena-Chat's real features (a list of Image, conversation turns) and MMVU's
    (a video URL, here on a loopback media host; read with --no-stream, through the
    datasets cache) from the fake Hub: every request carries the row's own image bytes or
    video URL and its prompt; a dataset of another schema stops with exit 2 and one line
    naming its columns, before any request."""
    import datasets

    port, seen = recording_mock
    jpegs = [synthetic.make_image(40, 30, fmt="JPEG", seed=s) for s in range(2)]
    clip = synthetic.make_video(width=64, height=48, fps=8, seconds=0.5, seed=3)
    clip_url = media_server.add("/mmvu/clip.mp4", clip, "video/mp4")
    arena_features = datasets.Features({
        "question_id": datasets.Value("string"), "images": datasets.List(datasets.Image()),
        "conversation": datasets.List(datasets.List({"role": datasets.Value("string"),
                                                     "content": datasets.Value("string")}))})
    with FakeHub() as hub:
        hub.add_repo("lmarena-ai/VisionArena-Chat", _parquet(tmp_path / "arena", {
            "question_id": ["a", "b"], "images": [[{"bytes": j, "path": None}] for j in jpegs],
            "conversation": [[[{"role": "user", "content": f"Describe picture {n}."},
                               {"role": "assistant", "content": "ok"}]] for n in range(2)]},
            arena_features), repo_type="dataset")
        hub.add_repo("yale-nlp/MMVU", _parquet(tmp_path / "mmvu", {
            "id": [1], "question": ["Where does it move?"], "video": [clip_url],
            "choices": [{"A": "up", "B": "down"}]}), repo_type="dataset")
        hub.add_repo("acme/text-only", _parquet(tmp_path / "text", {
            "prompt": ["hi"], "completion": ["yo"]}), repo_type="dataset")
        home = tmp_path / "hf"
        done = _bench(hub, home, port, "--dataset-name", "hf", "--dataset-path",
                      "lmarena-ai/VisionArena-Chat", "--hf-split", "train", "--num-prompts",
                      "3", "--hf-output-len", "9")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        chats = [e["body"] for e in seen if e["path"] != "/v1/models"]
        assert len(chats) == 3
        for n, body in enumerate(chats):  # rows in order, the first again for the third
            image, text = body["messages"][0]["content"]
            assert _data(image["image_url"]["url"]) == ("image/jpeg", jpegs[n % 2])
            assert text["text"] == f"Describe picture {n % 2}." and body["max_tokens"] == 9
        doc = json.loads((home / "out" / "hub.json").read_text())
        assert doc["dataset"] == "hf" and doc["hub_dataset"]["dataset_path"] == \
            "lmarena-ai/VisionArena-Chat" and doc["hub_dataset"]["hf_split"] == "train"
        assert doc["phases"]["cold"]["completed"] == 3

        seen.clear()
        done = _bench(hub, home, port, "--dataset-name", "hf", "--dataset-path",
                      "yale-nlp/MMVU", "--num-prompts", "2", "--no-stream")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        chats = [e["body"] for e in seen if e["path"] != "/v1/models"]
        assert [c["messages"][0]["content"] for c in chats] == [[
            {"type": "video_url", "video_url": {"url": clip_url}},
            {"type": "text", "text": "Where does it move? A.up B.down"}]] * 2
        assert list((home / "datasets").iterdir())  # --no-stream: in the datasets cache

        seen.clear()
        done = _bench(hub, home, port, "--dataset-name", "hf", "--dataset-path",
                      "acme/text-only")
        said = done.stdout + done.stderr
        assert done.returncode == 2 and "Traceback" not in said, said
        assert "no known dataset schema has the columns (prompt, completion)" in said
        assert not [e for e in seen if e["path"] != "/v1/models"]
        done = _bench(hub, home, port, "--dataset-name", "hf", "--dataset-path",
                      "acme/missing")
        said = done.stdout + done.stderr
        assert done.returncode == 2 and "Traceback" not in said, said
        assert "--dataset-path acme/missing (--hf-split train) could not be read" in said


def test_sharegpt_reads_a_local_json_file_of_conversations(tmp_path):
    """vLLM's ShareGPT file (a JSON list; JSON lines too), its image paths read from
    --media-dir; --num-prompts past its rows repeats them; a file of other rows names its
    columns."""
    from aphrodite_cli.bench.load.hub_datasets import HubArgs, load_named

    jpeg = synthetic.make_image(8, 8, fmt="JPEG", seed=4)
    (tmp_path / "a.jpg").write_bytes(jpeg)
    rows = [{"id": "1", "image": "a.jpg", "conversations": [
                {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "x"}]},
            {"id": "2", "conversations": [{"from": "human", "value": "Hello"}]}]
    listed = tmp_path / "sharegpt.json"
    listed.write_text(json.dumps(rows))
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    for path in (listed, lines):
        reqs = load_named("sharegpt", str(path), HubArgs(output_len=5), num_prompts=3,
                          output_len=16, media_dir=tmp_path)
        assert [r.prompt for r in reqs] == ["What is it?", "Hello", "What is it?"]
        assert _data(_parts(reqs[0])[0]["image_url"]["url"]) == ("image/jpeg", jpeg)
        assert _parts(reqs[1]) == [{"type": "text", "text": "Hello"}]
        assert {r.output_len for r in reqs} == {5}
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"question": "q", "images": []}]))
    with pytest.raises(ConfigError, match=r"the columns \(question, images\)"):
        load_named("sharegpt", str(other), HubArgs(), num_prompts=1, output_len=1)
