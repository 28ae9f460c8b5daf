"""Benchmark runners, result schema and reports, by concern (no Typer here; see ``cli.py``
and ``commands/``):

- ``load/``: load generation against a server (``bench serve``, ``sweep``, ``soak``): the
  client, datasets, metrics, the hostile catalogue and attackers, a mock server;
- ``offline/``: benchmarks without a server (``video-decode``, ``mm-processor``,
  ``batching``, ``decode-step``);
- ``data/``: the datasets both of them send (random-mm, JSONL, their media);
- ``results/``: result files (schema, write, load, the field names writers and readers
  share, a target's text made safe), statistics and confidence intervals, the environment,
  the gate and the report;
- ``harness/``: what a run stands up on this machine: synthetic media, the loopback media
  host, an ``aphrodite serve`` process (the tests take them through ``tests/fixtures.py``);
- ``commands/``: the Typer commands, one module per group, thin.

Layers (the ``bench-layers`` contract in ``pyproject.toml``): ``cli`` > ``commands`` >
``load`` | ``offline`` > ``data`` > ``results`` | ``harness``; a module imports only from
layers below its own, and ``load`` and ``offline`` not from each other.
"""
