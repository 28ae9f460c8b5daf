"""The API server's metrics: engine numbers when the engine does not answer a scrape in time,
restart counts as counters, and the totals several API server processes share."""

from __future__ import annotations

import re

from engine.server.api.metrics import Metrics


def test_engine_numbers_are_nan_not_stale_when_the_engine_does_not_answer():
    metrics = Metrics()
    metrics.set_engine({"rss_bytes": 123.0, "heap_in_use_bytes": 5.0,
                        "heap_free_bytes": 1.0, "gc_objects_collected": 2.0,
                        "requests_in_flight": 0.0})
    text = metrics.render().decode()
    assert re.search(r"^aphrodite_engine_rss_bytes 123\.0$", text, re.M)
    assert re.search(r"^aphrodite_engine_stats_up 1\.0$", text, re.M)
    metrics.set_engine(None)  # the engine did not answer within its 2 s
    text = metrics.render().decode()
    assert re.search(r"^aphrodite_engine_rss_bytes NaN$", text, re.M)
    assert re.search(r"^aphrodite_engine_stats_up 0\.0$", text, re.M)


def test_restarts_are_a_counter_that_follows_the_pools_count():
    metrics = Metrics()
    restarts = {"n": 0}
    metrics.follow(metrics.decode_restarts, lambda: restarts["n"])
    assert re.search(r"^aphrodite_decode_worker_restarts_total 0\.0$",
                     metrics.render().decode(), re.M)
    restarts["n"] = 2
    metrics.render()
    restarts["n"] = 3
    assert re.search(r"^aphrodite_decode_worker_restarts_total 3\.0$",
                     metrics.render().decode(), re.M)


_ONE_API_SERVER = """
import sys
from engine.server.api.metrics import Metrics
m = Metrics()
requests, running, engine_rss = (int(a) for a in sys.argv[1:4])
for _ in range(requests):
    m.requests.labels("/v1/chat/completions", "200").inc()
    m.vllm_generation_tokens.labels("tiny").inc(2)
m.vllm_running.labels("tiny").set(running)
m.set_engine({"rss_bytes": engine_rss})
if len(sys.argv) > 4:
    sys.stdout.write(m.render().decode())
"""


def test_processes_sharing_a_folder_report_the_sums(tmp_path):
    """What ``--api-server-count 2`` sets up: each process writes to the folder, a scrape of
    any one reads the totals; the engine's numbers are the latest any process fetched."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", _ONE_API_SERVER, "3", "1", "100"], env=env,
                   check=True)
    text = subprocess.run([sys.executable, "-c", _ONE_API_SERVER, "5", "2", "200", "render"],
                          env=env, check=True, capture_output=True, text=True).stdout
    assert re.search(r'^aphrodite_requests_total\{route="/v1/chat/completions",status="200"\} '
                     r'8\.0$', text, re.M)
    assert re.search(r'^vllm:generation_tokens_total\{model_name="tiny"\} 16\.0$', text, re.M)
    # requests running: the sum of what each process has in the engine
    assert re.search(r'^vllm:num_requests_running\{model_name="tiny"\} 3\.0$', text, re.M)
    assert re.search(r"^aphrodite_engine_rss_bytes 200\.0$", text, re.M)
    assert "process_open_fds" not in text  # per-process collectors cannot be summed
