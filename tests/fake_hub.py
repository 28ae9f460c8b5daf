"""A loopback fake of the Hugging Face Hub, for tests that download models without a network.

Stdlib only: a ThreadingHTTPServer on 127.0.0.1 (port 0) in a daemon thread. It implements what
``snapshot_download`` and ``hf_hub_download`` of huggingface_hub 2.4.0 request for a plain,
non-LFS, non-Xet download of a model repo (no ``lfs``/``xetHash`` tree fields and no ``X-Xet-*``
headers are ever sent, so the client always takes the plain HTTP path):

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``repo_info``,
  ``model_info``): ``id``, ``sha``, ``siblings`` [{"rfilename"}], ``private``, ``gated``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`` (``list_repo_tree``): entries
  ``{"type": "file"|"directory", "path", "size", "oid"}``, one page (no ``Link`` header);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, quoted ``ETag`` (the git blob
  sha1, as the Hub sends for non-LFS files), ``Content-Length``; the body on GET;
- ``GET /api/agent-harnesses`` (fetched once per process by the client's user-agent code unless
  ``HF_HUB_DISABLE_TELEMETRY=1``): an empty registry.

Dataset repos (``add_repo(..., repo_type="dataset")``) answer the same under
``/api/datasets/{repo}`` and ``/datasets/{repo}/resolve/...``: what ``datasets.load_dataset``
(5.2.0) asks for a parquet dataset, streamed or not (info, revision, tree listings, HEAD of
README.md / the loading script / ``.huggingface.yaml`` / ``dataset_infos.json``, each a 404,
then the parquet files).

Errors carry ``X-Error-Code`` as the Hub sends it, which ``hf_raise_for_status`` maps to
exceptions: unknown repo 404 ``RepoNotFound`` (RepositoryNotFoundError); unknown revision 404
``RevisionNotFound``; unknown file 404 ``EntryNotFound`` (RemoteEntryNotFoundError, with
``X-Repo-Commit`` so the client caches the miss). A gated repo lists its info and tree to
anyone, like the Hub, but ``/resolve`` without ``Authorization: Bearer <token>`` answers 401
(403 for a wrong token) ``GatedRepo`` (GatedRepoError). A repo with a token that is not gated
is private: every endpoint answers ``RepoNotFound`` without that token (401 anonymous, 404 wrong).

Revisions: ``main`` or the repo's commit sha, a sha1 of the repo id and its files (paths and
blob ids), so it is stable across runs. Files are read when the repo is added.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_KIND = r"(?P<kind>models|datasets)"
_TREE = re.compile(rf"/api/{_KIND}/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.+))?")
_INFO = re.compile(rf"/api/{_KIND}/{_REPO}(?:/revision/(?P<rev>[^/]+))?")
# a dataset's files are under /datasets/; a model's at the root
_RESOLVE = re.compile(rf"(?:/(?P<kind>datasets))?/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
# Where huggingface_hub finds a token of the user's (besides HF_HOME/token and Colab).
_USER_AUTH_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE")


def blob_id(data: bytes) -> str:
    """The git blob sha1 of ``data``: the ``oid`` and ``ETag`` the Hub gives a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Repo:
    files: dict[str, bytes]
    sha: str
    gated: bool
    token: str | None


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub  # set on the per-hub subclass

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve()

    def do_GET(self) -> None:
        self._serve()

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _json(self, data) -> None:
        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                  "X-Error-Message": message, **(headers or {})})

    def _serve(self) -> None:
        url = urlsplit(self.path)
        self.hub.requests.append((self.command, unquote(url.path)))
        if url.path == "/api/agent-harnesses":
            return self._json({"standardEnvVars": [], "harnesses": {}})
        match = (_TREE.fullmatch(url.path) or _INFO.fullmatch(url.path)
                 or _RESOLVE.fullmatch(url.path))
        if match is None:
            return self._error(404, "NotFound", f"no route for {url.path}")
        groups = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        repo_id, rev = groups["repo"], groups.get("rev", "main")
        repo_type = "dataset" if groups.get("kind") == "datasets" else "model"
        repo = self.hub.repos.get((repo_type, repo_id))
        auth = self.headers.get("Authorization")
        granted = repo is not None and repo.token is not None and auth == f"Bearer {repo.token}"
        if repo is None or (repo.token and not repo.gated and not granted):
            return self._error(401 if repo and not auth else 404, "RepoNotFound",
                               f"Repository not found: {repo_id}")
        if match.re is _RESOLVE and repo.gated and not granted:
            return self._error(403 if auth else 401, "GatedRepo",
                               f"Access to model {repo_id} is restricted.")
        if rev not in ("main", repo.sha):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if match.re is _INFO:
            return self._json({"_id": repo.sha[:24], "id": repo_id, "modelId": repo_id,
                               "sha": repo.sha, "private": bool(repo.token and not repo.gated),
                               "gated": "manual" if repo.gated else False, "disabled": False,
                               "tags": [], "siblings": [{"rfilename": p} for p in repo.files]})
        if match.re is _TREE:
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            return self._tree(repo, groups.get("sub", "").strip("/"), recursive)
        data = repo.files.get(groups["file"])
        if data is None:
            return self._error(404, "EntryNotFound", f"{groups['file']} does not exist",
                               {"X-Repo-Commit": repo.sha})
        self._send(200, data, {"Content-Type": "application/octet-stream",
                               "ETag": f'"{blob_id(data)}"', "X-Repo-Commit": repo.sha,
                               "Accept-Ranges": "none"})

    def _tree(self, repo: _Repo, sub: str, recursive: bool) -> None:
        prefix = f"{sub}/" if sub else ""
        entries: dict[str, dict] = {}
        for path, data in repo.files.items():
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            shown = parts if recursive else parts[:1]
            for depth in range(1, len(shown) + 1):
                entry = prefix + "/".join(shown[:depth])
                entries[entry] = (
                    {"type": "file", "path": path, "size": len(data), "oid": blob_id(data)}
                    if entry == path else
                    {"type": "directory", "path": entry, "size": 0,
                     "oid": hashlib.sha1(entry.encode()).hexdigest()})
        if sub and not entries:
            return self._error(404, "EntryNotFound", f"{sub} does not exist",
                               {"X-Repo-Commit": repo.sha})
        self._json([entries[k] for k in sorted(entries)])


class FakeHub:
    """A fake Hub on ``self.endpoint``; ``self.requests`` lists every (method, path) it got,
    the path unquoted and without its query. Stop it with ``close()`` or use it as a context."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], _Repo] = {}  # (repo type, id) -> repo
        self.requests: list[tuple[str, str]] = []
        handler = type("FakeHubHandler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="fake-hub", daemon=True)  # quick shutdown
        self._thread.start()

    def add_repo(self, repo_id: str, folder: Path, *, gated: bool = False,
                 token: str | None = None, repo_type: str = "model") -> str:
        """Serve every file under ``folder`` as ``repo_id`` (a ``model`` or ``dataset`` repo)
        at ``main``; returns the commit sha."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        listing = "\n".join(f"{path} {blob_id(data)}" for path, data in files.items())
        name = repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}"
        sha = hashlib.sha1(f"{name}\n{listing}".encode()).hexdigest()
        self.repos[(repo_type, repo_id)] = _Repo(files, sha, gated, token)
        return sha

    def downloads(self, method: str = "GET") -> list[str]:
        """Repo file paths requested through ``/resolve`` with ``method``, in request order."""
        found = (_RESOLVE.fullmatch(path) for m, path in self.requests if m == method)
        return [match["file"] for match in found if match]

    def client_env(self, home: Path) -> dict[str, str]:
        """``os.environ`` for a huggingface_hub client in a subprocess: this hub, the cache
        and token under ``home``, online, no telemetry (which would fetch the agent registry),
        no Xet, and no token or OIDC login of the user's."""
        env = {k: v for k, v in os.environ.items() if k not in _USER_AUTH_VARS}
        return {**env, "HF_ENDPOINT": self.endpoint, "HF_HOME": str(home),
                "HF_HUB_CACHE": str(Path(home) / "hub"), "HF_HUB_OFFLINE": "0",
                "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_XET": "1"}

    def patch_client(self, monkeypatch, home: Path) -> None:
        """The same for the huggingface_hub imported in this process: the env vars, and the
        ``huggingface_hub.constants`` that it read from them at import (the endpoint is also
        baked into ``HUGGINGFACE_CO_URL_TEMPLATE``)."""
        from huggingface_hub import constants

        env = self.client_env(home)
        for name in set(os.environ) - set(env):
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        template = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        for name, value in {
            "ENDPOINT": self.endpoint, "HUGGINGFACE_CO_URL_TEMPLATE": template,
            "HF_HOME": str(home), "HF_HUB_CACHE": env["HF_HUB_CACHE"],
            "HF_TOKEN_PATH": str(Path(home) / "token"),
            "HF_STORED_TOKENS_PATH": str(Path(home) / "stored_tokens"),
            "AGENT_HARNESSES_PATH": str(Path(home) / ".agent_harnesses.json"),
            "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_TELEMETRY": True, "HF_HUB_DISABLE_XET": True,
        }.items():
            monkeypatch.setattr(constants, name, value)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
