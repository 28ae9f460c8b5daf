"""A bound on the media bytes one API server holds at once (fetched, not yet preprocessed).

Each request takes a :class:`Ticket`; bytes are charged as they arrive (every HTTP chunk, a
data URL's decoded payload, a local file) and given back when the request's preprocessing
ends. A charge that would pass the bound fails at once with a 503 and ``Retry-After``: memory
stays bounded however many large items arrive together.
"""

from __future__ import annotations

from engine.errors import OverloadedError


class InflightBytes:
    """The bound and what is charged against it (one per API server; event-loop thread)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.in_use = 0

    def ticket(self) -> Ticket:
        return Ticket(self)


class Ticket:
    """One request's share; a context manager that gives everything back on exit."""

    def __init__(self, budget: InflightBytes) -> None:
        self.budget = budget
        self.held = 0
        #: True once the request body was charged: a data URL's bytes came in that body (its
        #: base64 is 4/3 of them), so decoding it charges nothing more.
        self.covers_inline_media = False

    def charge(self, nbytes: int) -> None:
        budget = self.budget
        if budget.in_use + nbytes > budget.limit_bytes:
            raise OverloadedError(
                f"this API server already holds {budget.in_use} bytes of media in flight; "
                f"{nbytes} more would pass the {budget.limit_bytes}-byte bound",
                hint="retry after the Retry-After seconds, or raise --max-inflight-media-mb",
                code="media_bytes_in_flight")
        budget.in_use += nbytes
        self.held += nbytes

    def refund(self, nbytes: int) -> None:
        nbytes = min(nbytes, self.held)
        self.budget.in_use -= nbytes
        self.held -= nbytes

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.refund(self.held)
