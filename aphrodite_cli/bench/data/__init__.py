"""The requests a benchmark sends that both ``load/`` (``bench serve``, ``sweep``, ``soak``)
and ``offline/`` (``bench mm-processor``) build: the random-mm and JSONL datasets, their media
rendered or read from ``--media-dir``, and where a target finds an item (a data URL or the
loopback media host). The datasets only ``bench serve`` reads (the Hub's, traces, sessions,
token prompts) live in ``load/``."""
