"""The ``aphrodite bench`` commands, one module per group; ``bench/cli.py`` registers them."""
