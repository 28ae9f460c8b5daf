"""``--engine vllm``: its requests' inputs and media, its engine's arguments and startup."""
