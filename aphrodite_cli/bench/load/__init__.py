"""Load generation against an OpenAI-compatible server: ``bench serve`` (``serve.py`` over
the client in ``client.py``), ``bench sweep`` and ``bench soak``, their datasets and metrics,
vLLM's conventions, the hostile catalogue and attackers, and a mock server to check them."""
