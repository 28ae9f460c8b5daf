"""The API server's metrics when the engine does not answer a scrape in time."""

from __future__ import annotations

import re

from engine.server.metrics import Metrics


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
