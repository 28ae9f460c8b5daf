"""The ``aphrodite bench`` commands: plain functions, one module per group, each with its
``--help`` epilog beside it; ``bench/cli.py`` registers them (nothing registers on import)."""
