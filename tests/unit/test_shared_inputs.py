"""Model inputs from an API server to the engine through /dev/shm: large arrays go as a
segment's name and come back equal, the name is gone once the engine maps it, small arrays
stay in the message, and segments that never reach an engine are removed."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from engine.media import frame_memory
from engine.server.process import shared_inputs


def segments() -> set[str]:
    return {p.name for p in frame_memory.SHM_DIR.glob(f"{frame_memory.PREFIX}*-in-*")}


def test_large_arrays_travel_by_name_and_the_name_goes_when_mapped():
    before = segments()
    pixels = np.random.default_rng(0).random((1200, 1176), dtype=np.float32)
    grid = np.array([[1, 30, 40]], dtype=np.int64)
    message, names = shared_inputs.export({"pixel_values": pixels, "image_grid_thw": grid})
    assert isinstance(message["pixel_values"], shared_inputs.SharedArray)
    assert message["image_grid_thw"] is grid  # small: through the pipe as before
    assert len(pickle.dumps(message)) < 1000  # the megabytes are not in the message
    assert segments() - before == set(names) and len(names) == 1
    got = shared_inputs.attach(pickle.loads(pickle.dumps(message)))
    assert segments() == before  # mapped: the name is gone, the memory stays with the array
    np.testing.assert_array_equal(got["pixel_values"], pixels)
    assert got["pixel_values"].flags.writeable
    np.testing.assert_array_equal(got["image_grid_thw"], grid)
    strided = pixels[:, ::2].T  # not contiguous: copied straight into the segment's layout
    back = shared_inputs.attach(shared_inputs.export({"p": strided})[0])["p"]
    np.testing.assert_array_equal(back, strided)
    assert segments() == before


def test_unsent_segments_are_removed_and_a_lost_one_is_an_error_that_removes_the_rest():
    before = segments()
    big = np.ones((256, 256), dtype=np.float32)
    _, names = shared_inputs.export({"a": big})
    shared_inputs.discard(names)
    assert segments() == before
    message, names = shared_inputs.export({"a": big, "b": big * 2})
    (frame_memory.SHM_DIR / names[0]).unlink()  # lost on the way (a cleanup raced it)
    with pytest.raises(OSError):
        shared_inputs.attach(message)
    assert segments() == before  # the other one was mapped and removed all the same


def test_segments_no_engine_mapped_are_removed_when_the_engine_goes():
    before = segments()
    shared_inputs.export({"a": np.ones((300, 300), dtype=np.float32)})
    shared_inputs.export({"b": np.ones((300, 300), dtype=np.float32)})
    assert len(segments() - before) == 2
    assert shared_inputs.discard_all() == 2
    assert segments() == before
