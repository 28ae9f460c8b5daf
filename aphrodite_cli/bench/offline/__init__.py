"""Benchmarks without a server: ``bench video-decode``, ``mm-processor`` and ``batching``."""
