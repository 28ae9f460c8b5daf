"""Benchmark runners, result schema and reports, by concern (no Typer here; see ``cli.py``
and ``commands/``):

- ``load/``: load generation against a server (``bench serve``, ``sweep``, ``soak``): the
  client, datasets, metrics, the hostile catalogue and attackers, a mock server;
- ``offline/``: benchmarks without a server (``video-decode``, ``mm-processor``,
  ``batching``);
- ``results/``: result files (schema, write, load), statistics, the environment, the gate
  and the report;
- ``harness/``: what a run stands up on this machine: synthetic media, the loopback media
  host, an ``aphrodite serve`` process (the tests take them through ``tests/fixtures.py``);
- ``commands/``: the Typer commands, one module per group, thin.
"""
