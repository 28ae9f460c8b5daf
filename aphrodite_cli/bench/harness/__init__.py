"""What a benchmark stands up on this machine: synthetic media (``synthetic.py``), the
loopback media host (``media_host.py``) and an ``aphrodite serve`` process
(``server_process.py``). The tests use the same three through ``tests/fixtures.py``."""
