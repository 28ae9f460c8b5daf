"""The process boundary: the engine process, its client and pool, the wire between them."""
