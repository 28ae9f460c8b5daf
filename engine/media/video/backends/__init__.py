"""One module per video backend, each imported only when chosen (see ``registry``)."""
