"""The engine socket's messages (engine/server/process/wire.py): each kind crosses a real
``multiprocessing`` connection as the type it left as, and a step's batch of deltas costs
about what the bare tuples it replaced cost (the class is written once per message)."""

from __future__ import annotations

import io
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler

import numpy as np

from engine.server.process import wire


def dumps(message: object) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(message)  # what Connection.send writes
    return buf.getvalue()


def test_every_kind_crosses_a_connection_as_itself():
    delta = wire.Delta("7-0", 1, 42, " hi", "stop", (-0.5, 1, [42, 7], [-0.5, -1.5]))
    messages = [
        wire.Submit("7-0", [1, 2, 3], {"pixel_values": np.arange(6, dtype=np.uint8)},
                    {"max_tokens": 4, "n": 2}, ["image-a"], [(1, 2)]),
        wire.Cancel("7-0"), wire.StatsQuery("7-stats-1"),
        wire.Events([delta, delta._replace(index=0, token_id=None, text="")]),
        wire.Done("7-0", [wire.Output(0, "hi", [42], "length")], {"decode_s": 0.1},
                  num_cached_tokens=16),
        wire.Done("7-1", [], {}, wire.Failure({"error": {"message": "x"}}, 400)),
        wire.Stats("7-stats-1", {"rss_bytes": 1.0}),
    ]
    sender, receiver = Pipe()
    try:
        for message in messages:
            sender.send(message)
            got = receiver.recv()
            assert type(got) is type(message)
            if isinstance(message, wire.Submit):
                assert got.rid == message.rid and got.input_ids == message.input_ids
                assert np.array_equal(got.mm["pixel_values"], message.mm["pixel_values"])
                assert got.sampling == message.sampling
                # the prefix cache names the media by their content keys and token ranges
                assert (got.mm_hashes, got.mm_positions) == (["image-a"], [(1, 2)])
            else:
                assert got == message
        assert not receiver.poll()
    finally:
        sender.close()
        receiver.close()


def test_a_steps_batch_names_its_class_once_and_costs_about_the_bare_tuples():
    deltas = [wire.Delta(f"123-{i % 8}", i % 2, 1000 + i, " tok", None, None)
              for i in range(64)]
    bare = [("event", *d) for d in deltas]
    typed = dumps(wire.Events(deltas))
    assert typed.count(b"Delta") == 1 and typed.count(b"Events") == 1
    # a memo reference and an opcode per delta more than the tuples with their tag string
    assert len(typed) <= len(dumps(("events", bare))) + 4 * len(deltas)
