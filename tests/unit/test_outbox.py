"""The disk outbox: order across segments, prepending, reopening, torn records, sealing."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import _outbox
from pipeline._outbox import Outbox, OutboxRecord


def records(first: int, count: int, *, size: int = 8) -> list[OutboxRecord]:
    """``count`` records numbered from ``first``; the number is in the id and the payload."""
    numbers = range(first, first + count)
    return [OutboxRecord(f"sg.events.t.s.turn.{i}", f"ev{i:06d}", f"{i:0{size}d}".encode()) for i in numbers]


def drain(outbox: Outbox) -> list[OutboxRecord]:
    """Everything in the outbox, oldest first, removing segments as the publisher's replay does."""
    out: list[OutboxRecord] = []
    while (oldest := outbox.oldest()) is not None:
        path, found = oldest
        out.extend(found)
        outbox.remove(path, len(found))
    assert len(outbox) == 0
    return out


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[Outbox]:
    box = Outbox(tmp_path / "outbox")
    yield box
    box.close()


def test_record_round_trips_unusual_fields(outbox: Outbox) -> None:
    odd = [
        OutboxRecord("sg.events._._.policy.updated", "ev1", b""),
        OutboxRecord("sg.events.t.h0123.session.opened", "é-id", b"\x00\xff" * 100_000),
    ]
    assert outbox.append(odd) == 2
    assert drain(outbox) == odd


def test_append_then_drain_keeps_order_across_segments(outbox: Outbox) -> None:
    outbox.append(records(0, 3))
    outbox.seal()
    outbox.append(records(3, 2))
    outbox.seal()
    outbox.append(records(5, 4))  # still the open tail
    assert len(outbox) == 9
    assert len(outbox.segments()) == 3

    path, first = outbox.oldest() or pytest.fail("empty")
    assert first == records(0, 3)
    outbox.remove(path, len(first))
    assert len(outbox) == 6
    assert drain(outbox) == records(3, 6)
    assert outbox.segments() == []
    assert outbox.oldest() is None


def test_full_segments_are_sealed_by_size(outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_outbox, "_SEGMENT_BYTES", 200)
    outbox.append(records(0, 20))  # ~40 bytes each: a new segment every 5
    assert len(outbox.segments()) == 4
    assert [len(Outbox.read(p)) for p in outbox.segments()] == [5, 5, 5, 5]
    assert drain(outbox) == records(0, 20)


def test_prepend_goes_before_everything(outbox: Outbox) -> None:
    outbox.append(records(10, 3))
    outbox.seal()
    outbox.append(records(13, 2))
    assert outbox.prepend(records(5, 5)) == 5
    assert outbox.prepend([]) == 0
    assert len(outbox) == 10
    outbox.append(records(15, 1))  # after a prepend, appends still go last
    assert drain(outbox) == records(5, 11)


def test_prepend_into_an_empty_outbox(outbox: Outbox) -> None:
    outbox.prepend(records(0, 2))
    outbox.append(records(2, 2))
    assert drain(outbox) == records(0, 4)


def test_a_new_instance_finds_the_leftovers(tmp_path: Path) -> None:
    directory = tmp_path / "outbox"
    first = Outbox(directory)
    first.append(records(0, 4))
    first.seal()
    first.append(records(4, 3))
    first.prepend(records(-2, 2))
    first.close()
    first.close()  # idempotent

    second = Outbox(directory)
    try:
        assert len(second) == 9
        second.append(records(7, 1))  # new events after the leftovers
        assert drain(second) == records(-2, 10)
    finally:
        second.close()


def test_appends_survive_a_process_that_never_closed(tmp_path: Path) -> None:
    """Appends are flushed at once, so a crash after ``append`` returns loses nothing."""
    directory = tmp_path / "outbox"
    crashed = Outbox(directory)
    try:
        crashed.append(records(0, 3))
        crashed.append(records(3, 1))
        reopened = Outbox(directory)
        assert len(reopened) == 4
        assert drain(reopened) == records(0, 4)
        reopened.close()
    finally:
        crashed.close()


@pytest.mark.parametrize("cut", [1, 3, 5, 20])
def test_a_torn_last_record_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: int) -> None:
    """``cut`` bytes missing from the end: inside the payload, the ids, or the length header."""
    directory = tmp_path / "outbox"
    writer = Outbox(directory)
    writer.append(records(0, 3, size=10))
    writer.close()
    (segment,) = writer.segments()
    last_record_size = len(records(2, 1, size=10)[0].encode())
    assert cut < last_record_size
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - cut])

    with caplog.at_level(logging.WARNING, logger="pipeline._outbox"):
        reader = Outbox(directory)
    try:
        assert "torn record" in caplog.text
        assert len(reader) == 2
        assert drain(reader) == records(0, 2, size=10)
    finally:
        reader.close()


def test_a_torn_header_only_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "outbox"
    writer = Outbox(directory)
    writer.append(records(0, 1))
    writer.close()
    (segment,) = writer.segments()
    with segment.open("ab") as f:
        f.write(b"\x00\x00")  # two bytes of the next record's four-byte length
    reader = Outbox(directory)
    try:
        assert drain(reader) == records(0, 1)
    finally:
        reader.close()


def test_replaying_the_tail_seals_it_so_new_appends_are_not_lost(outbox: Outbox) -> None:
    outbox.append(records(0, 2))
    path, found = outbox.oldest() or pytest.fail("empty")  # the segment being appended to
    assert found == records(0, 2)
    outbox.append(records(2, 2))  # arrives while that segment is being replayed
    assert outbox.segments()[-1] != path
    outbox.remove(path, len(found))
    assert len(outbox) == 2
    assert drain(outbox) == records(2, 2)


def test_unfinished_prepends_are_ignored(tmp_path: Path) -> None:
    """A ``.tmp`` left by a crash during ``prepend`` is not a segment."""
    directory = tmp_path / "outbox"
    directory.mkdir()
    (directory / f"{10**15 - 1:020d}.tmp").write_bytes(records(0, 1)[0].encode())
    reader = Outbox(directory)
    try:
        assert len(reader) == 0
        assert reader.oldest() is None
    finally:
        reader.close()


def test_remove_tolerates_a_missing_file(outbox: Outbox) -> None:
    outbox.append(records(0, 1))
    path, found = outbox.oldest() or pytest.fail("empty")
    path.unlink()
    outbox.remove(path, len(found))
    assert len(outbox) == 0
