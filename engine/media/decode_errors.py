"""Any decoder failure is the item's client error, never a dead worker or a 500.

Native decoders and their Python bindings fail in many ways on hostile input: PyAV raises
``ValueError`` or ``UnicodeDecodeError``, Pillow ``NotImplementedError``, a half-parsed
container leaves ``None`` where an attribute was expected (``AttributeError``). Whatever the
type, the cause is the bytes the client sent, so the answer is a 422 naming the item (see
:func:`name_item`); only a real crash (a signal, memory exhaustion) costs a decode worker.
"""

from __future__ import annotations

from engine.errors import AphroditeError, ClientError, MediaDecodeError, sanitize


def as_decode_error(kind: str, exc: BaseException) -> AphroditeError:
    """``exc``, raised while decoding a ``kind`` item, as the error a client gets."""
    if isinstance(exc, AphroditeError):
        return exc
    if isinstance(exc, MemoryError):
        return MediaDecodeError(
            f"decoding the {kind} needed more memory than a decoder may use",
            code="media_decode_memory",
            hint="send smaller media or fewer frames, or raise --decode-memory-gb")
    detail = sanitize(exc, limit=120)
    return MediaDecodeError(
        f"the {kind} could not be decoded ({type(exc).__name__}"
        + (f": {detail})" if detail else ")"),
        hint="the file is corrupt or uses a feature this server does not decode; "
             "re-encode it", code="media_decode_failed")


def name_item(err: ClientError, index: int, modality: str) -> ClientError:
    """Prefix the message with which item failed (1-based, in message order)."""
    prefix = f"media item {index + 1} ({modality}): "
    if not err.message.startswith(prefix):
        err.message = prefix + err.message
        err.args = (err.message,)
    return err
