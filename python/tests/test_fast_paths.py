"""The C-speed conversions of descriptor lists and index lists (``_core.pack_descs``,
``_core.pack_indices``): the same bytes as the checked Python path wherever they take
the input, and that path — with its exact errors — wherever they do not."""

from __future__ import annotations

import struct
import sys
import uuid
from array import array

import numpy as np
import pytest
from conftest import load_module, wait_xfer

pytestmark = pytest.mark.ours_only

api = load_module("_api")
B = load_module("_bindings")


def core():
    return sys.modules[B.__name__.rsplit(".", 1)[0] + "._core"]


def agent_module():
    return sys.modules[B.__name__.rsplit(".", 1)[0] + "._agent"]


ROWS = [(0x7F00_0000_0000 + 256 * i, 256, i % 3) for i in range(1000)] + [(2**64 - 1, 0, 0)]


class Rows(list):
    """A list subclass (``isinstance(x, list)`` takes it, as the checked path does)."""


@pytest.mark.parametrize("container", [list, tuple, Rows])
def test_pack_descs_gives_the_words_of_the_checked_path(container):
    packed = core().pack_descs(container(ROWS), 3)
    want = array("Q", [w for row in ROWS for w in row])
    assert packed == want.tobytes()
    tagged = [(*row, b"meta") for row in ROWS]
    assert core().pack_descs(container(tagged), 4) == want.tobytes()
    assert core().pack_descs(container(), 3) == b""


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, 3],  # a list, not a tuple
        (1, 2),  # too short
        (1, 2, 3, 4),  # too long for width 3
        (1, -2, 3),  # negative
        (2**64, 0, 0),  # too large
        (1.0, 2, 3),  # a float
        (np.uint64(1), 2, 3),  # another integer type: the checked path converts it
        "abc",
    ],
)
def test_pack_descs_leaves_anything_else_to_the_checked_path(bad):
    assert core().pack_descs([(1, 2, 3), bad], 3) is None
    assert core().pack_descs(((1, 2, 3), bad), 3) is None
    assert core().pack_descs({(1, 2, 3)}, 3) is None  # not a list or tuple


def test_descriptor_lists_keep_their_values_and_errors():
    d = B.nixlXferDList(B.DRAM_SEG, ROWS)
    assert len(d) == len(ROWS) and d[5] == ROWS[5] and d[-1] == ROWS[-1]
    # What the core receives, also after the list changed.
    words = array("Q", [w for row in ROWS for w in row])
    assert d._packed_bytes() == words.tobytes()
    d.append((1, 2, 3))
    d[0] = (4, 5, 6)
    words.extend((1, 2, 3))
    words[0:3] = array("Q", (4, 5, 6))
    assert d._packed_bytes() == words.tobytes()
    # Other integer types and bools still go through (the checked path).
    mixed = B.nixlXferDList(B.DRAM_SEG, [(np.uint64(7), np.int32(8), True)])
    assert mixed[0] == (7, 8, 1)
    with pytest.raises(ValueError, match="Each descriptor tuple must have exactly 3 elements"):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 3), (1, 2)])
    with pytest.raises(ValueError, match="descriptor fields must be non-negative"):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2, 3), (1, -2, 3)])
    with pytest.raises(OverflowError):
        B.nixlXferDList(B.DRAM_SEG, [(2**64, 1, 0)])
    reg = B.nixlRegDList(B.DRAM_SEG, [(1, 2, 3, "a"), (4, 5, 6, b"b")])
    assert reg[0] == (1, 2, 3, b"a") and reg[1] == (4, 5, 6, b"b")
    with pytest.raises(ValueError, match="exactly 4 elements"):
        B.nixlRegDList(B.DRAM_SEG, [(1, 2, 3)])


def test_pack_indices_gives_little_endian_i64_or_leaves_it_to_the_checked_path():
    ids = [0, 5, 2**63 - 1, -1, True]
    assert core().pack_indices(ids) == struct.pack("<5q", 0, 5, 2**63 - 1, -1, 1)
    assert core().pack_indices(tuple(ids)) == core().pack_indices(ids)
    assert core().pack_indices([]) == b""
    for bad in (2**63, 1.0, np.int64(3), "1", None):
        assert core().pack_indices([1, bad]) is None
    assert core().pack_indices(range(3)) is None  # not a list or tuple


def test_index_conversion_keeps_its_errors():
    to_bytes = agent_module()._index_bytes
    assert to_bytes([np.int64(4), 5]) == struct.pack("<2q", 4, 5)  # checked path
    assert to_bytes(np.array([4, 5], dtype=np.int32)) == struct.pack("<2q", 4, 5)
    with pytest.raises(TypeError, match="indices must be a list of ints or a 1D numpy array"):
        to_bytes([1, 2.5])
    with pytest.raises(OverflowError):
        to_bytes([2**63])


def test_negative_and_out_of_range_ids_in_a_list_are_refused_with_their_position():
    name = f"fast-{uuid.uuid4().hex[:8]}"
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["LIBFABRIC"]))
    buf = np.zeros(4096, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    rows = [(buf.ctypes.data + 256 * i, 256, 0) for i in range(16)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows[:8], "DRAM")
    remote = agent.prep_xfer_dlist(name, rows[8:], "DRAM")
    with pytest.raises(B.nixlInvalidParamError, match=r"index -1 \(position 1\) is negative"):
        agent.make_prepped_xfer("WRITE", local, [0, -1], remote, [0, 1])
    with pytest.raises(B.nixlError):
        agent.make_prepped_xfer("WRITE", local, [0, 8], remote, [0, 1])
    buf[:2048] = np.arange(2048) % 251
    h = agent.make_prepped_xfer("WRITE", local, [0, 3], remote, (7, 2))
    wait_xfer(agent, h, state=agent.transfer(h))
    agent.release_xfer_handle(h)
    assert (buf[8 * 256 + 7 * 256 : 8 * 256 + 8 * 256] == buf[0:256]).all()
    assert (buf[8 * 256 + 2 * 256 : 8 * 256 + 3 * 256] == buf[3 * 256 : 4 * 256]).all()
