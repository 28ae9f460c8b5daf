"""Model execution: sampling parameters, the transformers runner, the batching engine."""
