"""The OpenAI-compatible server: API server processes around one engine process."""
