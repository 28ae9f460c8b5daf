"""What the supervisor's fork server imports before it forks any child
(:data:`engine.server.fork_server.PRELOAD`): the libraries every child needs, then
``gc.freeze()``, so that the children's collections never touch (and copy) the pages of what
was imported here, and the fork server's own exit skips collecting them (about a second with
torch and transformers loaded, as :func:`engine.lifetime.exit_sooner` found for the engine).
Never prometheus_client: an API server sets its multiprocess folder before importing it.
A Ctrl-C during these imports ends the fork server quietly (:func:`_stopped`)."""

import gc
import os
import signal


def _stopped(signum: int, _frame: object) -> None:
    """A Ctrl-C reaches the whole foreground group, the fork server in these imports too: it
    ends here without a traceback (the supervisor stops the start-up and says so)."""
    os._exit(128 + signum)


# (only while it imports, and only where a Ctrl-C would raise: the handler the children get
# from the fork server is the one from before)
_before = signal.getsignal(signal.SIGINT)
if _before is signal.default_int_handler:
    signal.signal(signal.SIGINT, _stopped)

import torch  # noqa: E402, F401
import torchvision  # noqa: E402, F401
import transformers  # noqa: E402
import transformers.processing_utils  # noqa: E402, F401

gc.freeze()
if _before is signal.default_int_handler:
    signal.signal(signal.SIGINT, _before)
