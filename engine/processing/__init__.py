"""Prompt rendering, item limits, processor kwargs, the processor cache, preprocessing."""
