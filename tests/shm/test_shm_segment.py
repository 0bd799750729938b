"""Segments: names, mode, header validation, ownership."""

from __future__ import annotations

import os
import stat
import struct

import pytest

from shm.errors import ShmError
from shm.segment import HEADER, LAYOUT_VERSION, MAGIC, Segment, SegmentKind


def _mode(name: str) -> int:
    return stat.S_IMODE(os.stat(f"/dev/shm{name}").st_mode)


def test_create_is_0600_named_and_headed() -> None:
    old = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        seg = Segment.create(1000, SegmentKind.ARENA)
    finally:
        os.umask(old)
    with seg:
        assert seg.name.startswith(f"/tandem-{os.getpid()}-")
        assert len(seg.name.rsplit("-", 1)[1]) == 16
        assert _mode(seg.name) == 0o600
        assert seg.size % 4096 == 0 and seg.size >= 1000
        magic, version, kind, pid, size, _ = HEADER.unpack_from(seg.mm, 0)
        assert (magic, version, kind, pid, size) == (
            MAGIC,
            LAYOUT_VERSION,
            SegmentKind.ARENA,
            os.getpid(),
            seg.size,
        )
    assert not os.path.exists(f"/dev/shm{seg.name}")


def test_names_are_unguessable() -> None:
    a = Segment.create(64, SegmentKind.RING)
    b = Segment.create(64, SegmentKind.RING)
    with a, b:
        assert a.name != b.name


def test_attach_sees_owner_bytes_and_only_closes() -> None:
    with Segment.create(4096, SegmentKind.ARENA) as owner:
        owner.mm[100:105] = b"hello"
        peer = Segment.attach(owner.name, SegmentKind.ARENA)
        assert bytes(peer.mm[100:105]) == b"hello"
        assert not peer.owner and peer.owner_pid == os.getpid() and peer.owner_alive()
        peer.close()
        assert os.path.exists(f"/dev/shm{owner.name}")  # a peer never unlinks


@pytest.mark.parametrize(
    "name",
    [
        "tandem-1-0123456789abcdef",
        "/tandem-1-0123456789ABCDEF",
        "/etc/passwd",
        "/tandem-1-xyz",
        "/tandem-1-0123456789abcdef/../x",
        "",
        42,
    ],
)
def test_attach_rejects_foreign_names(name: object) -> None:
    with pytest.raises(ShmError, match="bad segment name"):
        Segment.attach(name, SegmentKind.ARENA)  # type: ignore[arg-type]


def test_attach_unknown_segment() -> None:
    with pytest.raises(ShmError, match="unknown segment"):
        Segment.attach("/tandem-1-0000000000000000", SegmentKind.ARENA)


@pytest.mark.parametrize(
    ("offset", "value", "problem"),
    [
        (0, b"NOTOURS!", "bad magic"),
        (8, struct.pack("<I", 99), "layout version 99"),
        (12, struct.pack("<I", SegmentKind.RING), "expected arena"),
        (24, struct.pack("<Q", 1 << 40), "header says"),
    ],
)
def test_attach_validates_header(offset: int, value: bytes, problem: str) -> None:
    with Segment.create(4096, SegmentKind.ARENA) as owner:
        owner.mm[offset : offset + len(value)] = value
        with pytest.raises(ShmError, match=problem):
            Segment.attach(owner.name, SegmentKind.ARENA)


def test_check_catches_a_header_scribbled_after_attach() -> None:
    with Segment.create(4096, SegmentKind.ARENA) as owner:
        peer = Segment.attach(owner.name, SegmentKind.ARENA)
        peer.check()
        owner.mm[0:8] = b"\0" * 8
        with pytest.raises(ShmError, match="bad magic"):
            peer.check()
        peer.close()


def test_close_with_live_views_does_not_unmap_under_them() -> None:
    seg = Segment.create(4096, SegmentKind.ARENA)
    view = memoryview(seg.mm)[64:72]
    view[:] = b"stillok!"
    seg.close()
    assert bytes(view) == b"stillok!"  # would segfault had close unmapped
    assert seg.closed and not os.path.exists(f"/dev/shm{seg.name}")
    view.release()


def test_garbage_collected_owner_unlinks() -> None:
    seg = Segment.create(4096, SegmentKind.ARENA)
    path = f"/dev/shm{seg.name}"
    assert os.path.exists(path)
    del seg
    assert not os.path.exists(path)
