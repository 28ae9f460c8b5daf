"""The engine process's outbox to an API server: over a real socket pair, its messages arrive
whole and in order, the engine thread does not wait on a reader that is slow (up to the
outbox's limit, past which it does, instead of holding unbounded memory), and a closed peer
costs nothing but the dropped messages."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

from engine.server.process.outbox import Outbox
from engine.server.process.wire import Delta, Events

#: messages of ~1 KB: 2 MB is far more than a socket pair's buffers on Linux (a few hundred KB),
#: so a writer without the outbox would block in its write until the reader starts, and
#: fewer than the outbox's default limit (4096)
COUNT = 2000


def _events(i: int) -> Events:
    return Events([Delta(f"r{i}", 0, i, "x" * 1000, None, None)])


def _put_all(outbox: Outbox, count: int) -> threading.Event:
    done = threading.Event()

    def produce() -> None:
        for i in range(count):
            outbox.put(_events(i))
        done.set()

    threading.Thread(target=produce, daemon=True).start()
    return done


def test_messages_arrive_in_order_while_put_never_waited_for_the_reader():
    reader, writer = Pipe(duplex=True)
    outbox = Outbox(writer)
    # nobody reads yet: a direct conn.send would block for good, long before the last put
    assert _put_all(outbox, COUNT).wait(60.0)
    got = [reader.recv() for _ in range(COUNT)]
    assert [e.deltas[0].token_id for e in got] == list(range(COUNT))
    assert all(e.deltas[0].text == "x" * 1000 for e in got)
    outbox.close()
    writer.close()
    reader.close()


def test_past_its_limit_put_waits_for_the_writer():
    reader, writer = Pipe(duplex=True)
    outbox = Outbox(writer, limit=8)
    done = _put_all(outbox, COUNT)
    # the socket's buffers and the 8 queued messages hold far less than the 2 MB put
    assert not done.wait(1.0)
    for i in range(COUNT):
        assert reader.recv().deltas[0].token_id == i
    assert done.wait(60.0)
    outbox.close()
    writer.close()
    reader.close()


def test_a_closed_peer_drops_the_messages_and_close_returns():
    reader, writer = Pipe(duplex=True)
    reader.close()
    outbox = Outbox(writer)
    for i in range(100):
        outbox.put(_events(i))
    outbox.close(timeout=10.0)
    assert not outbox._thread.is_alive()
    writer.close()


def test_close_writes_what_was_put_first():
    reader, writer = Pipe(duplex=True)
    outbox = Outbox(writer)
    for i in range(50):
        outbox.put(_events(i))
    outbox.close()
    assert [reader.recv().deltas[0].token_id for _ in range(50)] == list(range(50))
    assert not reader.poll(0.2)
    writer.close()
    reader.close()


def test_after_close_or_a_broken_peer_put_never_waits():
    """Messages put after close (a cancelled request's last events, a cache reset to an API
    server that left) or after a write failed are dropped: a small queue nobody writes out
    would otherwise stop the engine thread in ``put``."""
    reader, writer = Pipe(duplex=True)
    outbox = Outbox(writer, limit=8)
    outbox.close()
    broken_reader, broken_writer = Pipe(duplex=True)
    broken_reader.close()
    broken = Outbox(broken_writer, limit=8)
    finished = threading.Event()

    def flood() -> None:
        for i in range(100):
            outbox.put(_events(i))
            broken.put(_events(i))
        finished.set()

    threading.Thread(target=flood, daemon=True).start()
    assert finished.wait(30.0), "put waited on a queue nobody writes out"
    assert not reader.poll(0.1)
    broken.close(timeout=10.0)
    for conn in (reader, writer, broken_writer):
        conn.close()


def test_a_message_that_cannot_be_sent_does_not_stop_the_writer():
    reader, writer = Pipe(duplex=True)
    outbox = Outbox(writer)
    outbox.put(lambda: None)  # not picklable
    outbox.put(_events(7))
    outbox.close()
    assert reader.poll(10.0), "the writer stopped at the message it could not send"
    assert reader.recv().deltas[0].token_id == 7
    writer.close()
    reader.close()
