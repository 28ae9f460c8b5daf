"""The fake Hub (tests/fake_hub.py) against the real huggingface_hub client.

The client runs in this process: ``FakeHub.patch_client`` sets the env vars and also the
``huggingface_hub.constants`` read from them at import (``ENDPOINT``, the endpoint baked into
``HUGGINGFACE_CO_URL_TEMPLATE``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, token paths...), all
undone by monkeypatch. That is faster than a subprocess per call and lets the tests catch the
client's own exceptions; one test runs the client in a subprocess with ``client_env`` only, the
way a server or CLI the suite starts would see it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub

FILES = {
    "config.json": b'{"model_type": "tiny"}',
    "model.safetensors": bytes(range(256)) * 4,
    "README.md": b"# tiny\n",
    "tokenizer/vocab.txt": b"a\nb\nc\n",
}


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "src"
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in folder.rglob("*") if p.is_file()}


def test_snapshot_download_fetches_every_file_then_serves_offline(hub, source, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    sha = hub.add_repo("acme/tiny", source)
    folder = Path(snapshot_download("acme/tiny", revision="main"))
    assert folder.name == sha and folder.parent.name == "snapshots"
    assert _tree(folder) == FILES
    assert hub.requests[:2] == [("GET", "/api/models/acme/tiny/revision/main"),
                                ("GET", f"/api/models/acme/tiny/tree/{sha}")]
    assert sorted(hub.downloads("HEAD")) == sorted(hub.downloads("GET")) == sorted(FILES)
    assert len(hub.requests) == 2 + 2 * len(FILES)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    seen = len(hub.requests)
    assert Path(snapshot_download("acme/tiny", revision="main")) == folder
    assert Path(snapshot_download("acme/tiny", allow_patterns=["*.json"])) == folder
    assert len(hub.requests) == seen


def test_allow_patterns_fetch_only_the_matching_files(hub, source):
    from huggingface_hub import snapshot_download

    sha = hub.add_repo("acme/tiny", source)
    # a commit sha skips the revision look-up: the tree listing is the first request
    folder = Path(snapshot_download("acme/tiny", revision=sha,
                                    allow_patterns=["*.json", "tokenizer/*"]))
    assert _tree(folder) == {k: v for k, v in FILES.items() if k != "model.safetensors"
                             and k != "README.md"}
    assert hub.requests[0] == ("GET", f"/api/models/acme/tiny/tree/{sha}")
    assert sorted(hub.downloads()) == ["config.json", "tokenizer/vocab.txt"]


def test_model_info_and_tree_listing(hub, source):
    from huggingface_hub import HfApi, RepoFile, RepoFolder

    sha = hub.add_repo("acme/tiny", source)
    info = HfApi().model_info("acme/tiny")
    assert info.sha == sha and info.id == "acme/tiny" and not info.gated
    assert sorted(s.rfilename for s in info.siblings) == sorted(FILES)
    top = list(HfApi().list_repo_tree("acme/tiny"))
    assert {e.path for e in top if isinstance(e, RepoFolder)} == {"tokenizer"}
    assert {e.path: e.size for e in top if isinstance(e, RepoFile)} == {
        k: len(v) for k, v in FILES.items() if "/" not in k}


def test_missing_repo_revision_and_file_raise_the_clients_errors(hub, source):
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub.add_repo("acme/tiny", source)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("acme/missing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "config.json")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("acme/tiny", revision="v9")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("acme/tiny", "nope.bin")
    assert hub.downloads() == []


def test_gated_repo_needs_its_token(hub, source):
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import GatedRepoError

    hub.add_repo("acme/gated", source, gated=True, token="hf_right")
    assert HfApi().model_info("acme/gated").gated == "manual"  # info is public, as on the Hub
    with pytest.raises(GatedRepoError) as anonymous:
        snapshot_download("acme/gated")
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as wrong:
        hf_hub_download("acme/gated", "config.json", token="hf_wrong")
    assert wrong.value.response.status_code == 403
    assert hub.downloads() == []
    folder = Path(snapshot_download("acme/gated", token="hf_right"))
    assert _tree(folder) == FILES


def test_private_repo_is_not_found_without_its_token(hub, source):
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    hub.add_repo("acme/private", source, token="hf_right")
    with pytest.raises(RepositoryNotFoundError) as info:
        snapshot_download("acme/private")
    assert not isinstance(info.value, GatedRepoError)
    assert _tree(Path(snapshot_download("acme/private", token="hf_right"))) == FILES


def test_client_in_a_subprocess_needs_only_the_env(source, tmp_path):
    code = ("import sys; from huggingface_hub import snapshot_download; "
            "print(snapshot_download(sys.argv[1], allow_patterns=['*.json']))")
    with FakeHub() as fake:
        sha = fake.add_repo("acme/tiny", source)
        done = subprocess.run([sys.executable, "-c", code, "acme/tiny"], capture_output=True,
                              text=True, timeout=60, env=fake.client_env(tmp_path / "hf"))
        assert done.returncode == 0, done.stderr
        folder = Path(done.stdout.strip())
        assert folder == tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots" / sha
        assert _tree(folder) == {"config.json": FILES["config.json"]}
        assert fake.downloads() == ["config.json"]
        assert ("GET", "/api/agent-harnesses") not in fake.requests
