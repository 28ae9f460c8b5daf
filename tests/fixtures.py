"""What the tests take from the product's local harness, in one place: synthetic media
(codec-real, deterministic, every video frame distinct), the loopback media host and the
helper that starts an ``aphrodite serve`` process and waits for it.

The benchmarks need the same three things (``bench serve``, ``sweep`` and ``soak`` start a
server and host media; every dataset is synthetic media), so they live in the product and
this module is the only file under ``tests/`` that imports them from there (with the
hostile media the catalogue sends, ``hostile_media``)
(``tests/unit/test_layers.py`` checks it, and that the product never imports ``tests``). A test
that needs one of them imports it from here, and a move inside the product changes this
file alone.
"""

from __future__ import annotations

from aphrodite_cli.bench.harness import hostile_media, server_process, synthetic, synthetic_caps
from aphrodite_cli.bench.harness.media_host import MediaHost, drip

__all__ = ["MediaHost", "drip", "hostile_media", "server_process", "synthetic",
           "synthetic_caps"]
