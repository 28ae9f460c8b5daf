"""`aphrodite bench soak`: valid and hostile requests against the server for a set time.

Valid requests are drawn like `bench serve`'s random-mm dataset (images and videos, cold and
cached). Reports: 5xx answers to valid requests (must be zero), every hostile request's status and
error code against those it must get (the catalogue is in ``hostile.py``), RSS and open file
descriptors of every server process over time (flat after warm-up), temp files and shared
memory segments left behind, decode-worker restarts.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aphrodite_cli.bench.load import scrape
from aphrodite_cli.bench.load.server_cpu import fd_links
from aphrodite_cli.bench.results.stats import summary
from engine.memory import rss_bytes

if TYPE_CHECKING:
    from aphrodite_cli.bench.load.attackers import Attackers


def post(base: str, body: bytes, content_type: str = "application/json",
         path: str = "/chat/completions") -> tuple[int, str | None]:
    """(status, error code) of one request (chat unless ``path`` says otherwise); status 0
    when the connection failed."""
    req = urllib.request.Request(f"{base}{path}", data=body,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status, None
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return err.code, None
    except OSError:
        return 0, None


def metrics(base: str, *names: str) -> dict[str, float | None]:
    """Unlabelled values from one scrape of the server's /metrics (None: absent or
    unreachable)."""
    root = base.removesuffix("/v1")
    try:
        text = urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
    except OSError:
        text = ""
    try:
        found = scrape.parse(text, gauges=True)
    except (ValueError, TypeError, IndexError):  # not Prometheus text
        found = {}
    return {name: found.get(name) for name in names}


def decode_worker_restarts(base: str) -> int | None:
    """The server's decode-worker restarts, from /metrics (None when not isolated)."""
    name = "aphrodite_decode_worker_restarts_total"
    value = metrics(base, name)[name]
    return None if value is None else int(value)


def _shm_segments(owners: set[int]) -> set[str]:
    """The server's shared-memory segments held by something: named by its API server pids
    (another server on the same machine has segments of its own that are none of this soak's
    business); the free ones each decode worker keeps to decode into are not leftovers."""
    from engine.media import frame_memory

    return {p.name for p in frame_memory.SHM_DIR.glob(f"{frame_memory.PREFIX}*")
            if frame_memory.owner_pid(p.name) in owners
            and not p.name.endswith(frame_memory.FREE)}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def sample_processes(roles: dict[str, int]) -> dict[str, Any]:
    """RSS per role (decode workers summed under their API server), total RSS and open fds
    of the whole tree."""
    by_role: dict[str, int] = {}
    fds = 0
    seen: set[int] = set()
    for role, pid in roles.items():
        by_role[role] = rss_bytes(pid) or 0
        seen.add(pid)
        if role.startswith("api"):
            workers = _children(pid)
            by_role[f"{role}-decode-workers"] = sum(rss_bytes(w) or 0 for w in workers)
            seen.update(workers)
    todo = [roles.get("supervisor", 0)]
    while todo:  # anything else in the tree (e.g. the resource tracker)
        pid = todo.pop()
        if pid and pid not in seen:
            seen.add(pid)
            by_role["other"] = by_role.get("other", 0) + (rss_bytes(pid) or 0)
        todo += _children(pid) if pid else []
    sockets = 0
    role_of = {pid: role for role, pid in roles.items()}
    fds_by_role: dict[str, int] = {}
    for pid in seen:
        links = fd_links(pid)
        if links is None:
            continue  # the process ended meanwhile
        # Sockets come and go with the clients and the attacks: counted apart, so the open
        # files (regular files, pipes, shared memory, event fds) stay a leak measure.
        socket_links = sum(link.startswith("socket:") for link in links)
        sockets += socket_links
        fds += len(links) - socket_links
        role = role_of.get(pid, "other")
        fds_by_role[role] = fds_by_role.get(role, 0) + len(links) - socket_links
    return {"rss_bytes": sum(by_role.values()), "open_fds": fds, "open_sockets": sockets,
            "rss_by_role": by_role, "open_fds_by_role": fds_by_role}


def slope_mb_per_min(samples: list[dict[str, Any]], key: str | None = None, *,
                     field: str | None = None) -> float | None:
    """Least-squares RSS slope over the samples (MB/min); ``key``: one role; ``field``: another
    byte count of the samples instead of RSS (samples without it are skipped)."""
    if field:
        # a scrape the engine did not answer in time reads NaN: no point, not a wrong one
        points = [(s["t_s"], s[field] / 2**20) for s in samples
                  if s.get(field) is not None and math.isfinite(s[field])]
    else:
        points = [(s["t_s"], (s["rss_by_role"].get(key, 0) if key else s["rss_bytes"]) / 2**20)
                  for s in samples]
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return round(60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var, 3)


SOAK_BUCKETS = {(64, 96, 1): 0.5, (240, 320, 1): 0.25, (240, 320, 30): 0.25}


def valid_requests(model: str, buckets: dict[tuple[int, int, int], float], count: int,
                   seed: int) -> list[tuple[str, bytes]]:
    """``count`` distinct valid chat requests drawn like `bench serve --dataset random-mm`
    (its dataset and media generator; one item each, images and videos by ``buckets``),
    rendered once. Non-streaming, so a failure shows in the status. Named valid-image /
    valid-video."""
    from aphrodite_cli.bench.data.datasets import media_url, random_mm, render_media

    pool = []
    for req in random_mm(count, items=1, buckets=buckets, prompt_len=6, output_len=4,
                         seed=seed, nonce=seed + 1):
        spec = req.media[0]
        part = "image_url" if spec.kind == "image" else "video_url"
        body = {"model": model, "max_tokens": req.output_len, "messages": [
            {"role": "user", "content": [
                {"type": part, part: {"url": media_url(spec, render_media(spec), None)}},
                {"type": "text", "text": req.prompt}]}]}
        pool.append((f"valid-{spec.kind}", json.dumps(body).encode()))
    return pool


def run_soak(base_url: str, model: str, roles: dict[str, int], *, duration_s: float,
             hostile_share: float, concurrency: int, seed: int, media_base: str,
             warmup_s: float, buckets: dict[tuple[int, int, int], float] | None = None,
             valid_pool: int = 128, attackers: Attackers | None = None,
             temp_dir: Path | None = None) -> dict[str, Any]:
    """``concurrency`` clients send requests back to back for ``duration_s``, drawn from a
    pool of valid requests (``valid_requests``) and, a ``hostile_share`` of them, from the
    hostile catalogue (each checked against its status and rule), while ``attackers`` run
    alongside from their own address (each answer checked against its rule); server
    processes sampled every 2 s; valid requests' latency reported. ``temp_dir``: the
    server's own temp folder (its ``TMPDIR``): whatever appears in it is a leftover;
    without it, new names holding "aphrodite" in the system's temp folder are (another
    program's, on a shared machine, among them)."""
    from aphrodite_cli.bench.load.attackers import EXPECTED
    from aphrodite_cli.bench.load.hostile import hostile_catalogue

    catalogue = hostile_catalogue(model, media_base)
    valid = valid_requests(model, buckets or SOAK_BUCKETS, valid_pool, seed)
    temp_root = temp_dir or Path(tempfile.gettempdir())
    temp_before = {p.name for p in temp_root.iterdir()}
    api_pids = {pid for role, pid in roles.items() if role.startswith("api")}
    shm_before = _shm_segments(api_pids)
    # (kind, expected status, rule, status, code, seconds)
    results: list[tuple[str, int, str | None, int, str | None, float]] = []
    samples: list[dict[str, Any]] = []
    start = time.monotonic()

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() - start < duration_s:
            if rng.random() < hostile_share:
                case = rng.choice(catalogue)
                name, body, status, code = case.name, case.body, case.status, case.code
                ctype, path = case.content_type, case.path
            else:
                name, body = rng.choice(valid)
                status, code, ctype, path = 200, None, "application/json", "/chat/completions"
            sent = time.monotonic()
            answer = post(base_url, body, ctype, path)
            results.append((name, status, code, *answer, time.monotonic() - sent))

    for case in (c for c in catalogue if c.first):  # what later cases need (a uuid's media)
        sent = time.monotonic()
        answer = post(base_url, case.body, case.content_type, case.path)
        results.append((case.name, case.status, case.code, *answer, time.monotonic() - sent))
    if attackers is not None:
        attackers.start()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(client, i) for i in range(concurrency)]
        def sample() -> dict[str, Any]:
            # glibc heap in live blocks of the API server and the engine: a leak raises it, a
            # new allocator high-water mark (freed memory kept on purpose) raises only RSS
            heap = metrics(base_url, "aphrodite_heap_in_use_bytes",
                           "aphrodite_engine_heap_in_use_bytes")
            return {"t_s": round(time.monotonic() - start, 2), **sample_processes(roles),
                    "api_heap_in_use_bytes": heap["aphrodite_heap_in_use_bytes"],
                    "engine_heap_in_use_bytes": heap["aphrodite_engine_heap_in_use_bytes"]}

        while not all(f.done() for f in futures):
            samples.append(sample())
            time.sleep(2.0)
        for f in futures:
            f.result()
        samples.append(sample())
    if attackers is not None:
        attackers.stop()
    settled = _settled_sample(sample)
    restarts = decode_worker_restarts(base_url)
    temp_after = {p.name for p in temp_root.iterdir()}
    leftovers = sorted(n for n in temp_after - temp_before
                       if temp_dir is not None or "aphrodite" in n)
    leftovers += sorted(f"/dev/shm/{n}" for n in _shm_segments(api_pids) - shm_before)
    by_kind: dict[str, Counter] = {}
    mismatches = []
    for name, expected, rule, status, code, _ in results:
        by_kind.setdefault(name, Counter())[str(status)] += 1
        if status != expected or (rule is not None and code != rule):
            mismatches.append({"request": name, "expected": expected, "rule": rule,
                               "got": status, "code": code})
    for name, status, code, _ in (attackers.results if attackers is not None else []):
        by_kind.setdefault(name, Counter())[str(status)] += 1
        if (status, code) not in EXPECTED[name]:
            mismatches.append({"request": name, "expected": sorted(EXPECTED[name]),
                               "got": status, "code": code})
    valid_s = [r[5] for r in results if r[0].startswith("valid")]
    after_warmup = [s for s in samples if s["t_s"] >= warmup_s] or samples
    first, last = after_warmup[0], after_warmup[-1]
    second_half = [s for s in samples if s["t_s"] >= duration_s / 2]
    valid_5xx = sum(1 for r in results
                    if r[0].startswith("valid") and (r[3] >= 500 or r[3] == 0))
    return {
        "kind": "soak", "duration_s": duration_s,
        "concurrency": concurrency, "hostile_share": hostile_share, "seed": seed,
        "valid_pool": len(valid),
        "buckets": {",".join(map(str, k)): v for k, v in (buckets or SOAK_BUCKETS).items()},
        "catalogue": [{"name": c.name, "status": c.status, "rule": c.code} for c in catalogue],
        "requests": len(results), "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "valid_5xx": valid_5xx, "hostile_mismatches": mismatches[:200],
        "hostile_mismatch_count": len(mismatches),
        "attackers": None if attackers is None else attackers.counts(),
        # latency of valid requests (seconds, non-streaming: the whole answer)
        "valid_latency_s": summary(valid_s),
        "decode_worker_restarts": restarts,
        "process_samples": samples,
        "rss_growth_after_warmup": (last["rss_bytes"] - first["rss_bytes"]) / max(
            first["rss_bytes"], 1),
        "rss_growth_after_warmup_by_role": {
            role: last["rss_by_role"].get(role, 0) - first["rss_by_role"].get(role, 0)
            for role in last["rss_by_role"]},
        # a leak keeps rising to the end; a warm-up (arenas, caches filling) levels off
        "rss_slope_second_half_mb_per_min": slope_mb_per_min(second_half),
        "rss_slope_second_half_by_role_mb_per_min": {
            role: slope_mb_per_min(second_half, role) for role in last["rss_by_role"]},
        "heap_in_use_slope_second_half_mb_per_min": {
            role: slope_mb_per_min(second_half, field=f"{role}_heap_in_use_bytes")
            for role in ("api", "engine")},
        # open files once the load and the attacks ended and the count settled, against the
        # first sample after warm-up: what requests had open under load (an upload being
        # read, a decode's pipe) is closed by then, a leaked one stays open
        "settled_sample": settled,
        "fd_growth_after_warmup": settled["open_fds"] - first["open_fds"],
        "fd_growth_after_warmup_by_role": {
            role: n - first["open_fds_by_role"].get(role, 0)
            for role, n in settled["open_fds_by_role"].items()},
        "temp_leftovers": leftovers,
    }


#: how long the open files may take to settle once the load ended (s), and the wait between
#: two samples that must agree
SETTLE_S, SETTLE_STEP_S = 15.0, 0.5


def _settled_sample(sample: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A process sample once two taken ``SETTLE_STEP_S`` apart count the same open files
    (requests and workers finishing close theirs), or the last after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    last = sample()
    while time.monotonic() < deadline:
        time.sleep(SETTLE_STEP_S)
        now = sample()
        if now["open_fds"] == last["open_fds"]:
            return now
        last = now
    return last


def failures(doc: dict[str, Any], *, max_rss_growth: float,
             max_p99_ratio: float) -> list[str]:
    """Why a soak result is not clean (empty: clean): a valid request's 5xx, a hostile
    request or attack answered by another rule, any decode-worker restart (no kind may cost
    one: a decoder's own failure is its item's 4xx), temp files or shared memory left, RSS
    growth after warm-up, valid p99 over ``max_p99_ratio`` times the baseline's."""
    out = []
    if doc["valid_5xx"]:
        out.append(f"{doc['valid_5xx']} valid requests got a 5xx or no answer")
    if doc["hostile_mismatch_count"]:
        out.append(f"{doc['hostile_mismatch_count']} hostile requests or attacks were "
                   "answered by another rule than their own")
    if doc["decode_worker_restarts"]:
        out.append(f"{doc['decode_worker_restarts']} decode workers were replaced")
    if doc["temp_leftovers"]:
        out.append(f"{len(doc['temp_leftovers'])} temp files or shared-memory segments left")
    if doc["rss_growth_after_warmup"] > max_rss_growth:
        out.append(f"RSS grew {doc['rss_growth_after_warmup']:+.1%} after warm-up "
                   f"(at most {max_rss_growth:+.0%})")
    ratio = (doc.get("baseline") or {}).get("p99_ratio")
    if ratio is not None and ratio > max_p99_ratio:
        out.append(f"valid p99 latency is {ratio}x the baseline's (at most {max_p99_ratio:g}x)")
    return out
