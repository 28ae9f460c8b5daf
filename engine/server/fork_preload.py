"""What the supervisor's fork server imports before it forks any child
(:data:`engine.server.fork_server.PRELOAD`): the libraries every child needs, then
``gc.freeze()``, so that the children's collections never touch (and copy) the pages of what
was imported here, and the fork server's own exit skips collecting them (about a second with
torch and transformers loaded, as :func:`engine.lifetime.exit_sooner` found for the engine).
Never prometheus_client: an API server sets its multiprocess folder before importing it."""

import gc

import torch  # noqa: F401
import torchvision  # noqa: F401
import transformers
import transformers.processing_utils  # noqa: F401

gc.freeze()
