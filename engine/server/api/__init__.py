"""The HTTP front end: the FastAPI app, request fields and their limits, replies."""
