"""The disk outbox: durable events waiting for NATS, in order, surviving a restart.

A directory of segment files. Each segment is a sequence of records::

    u32 record length | u16 subject length | subject | u16 id length | msg id | payload

New records are appended to the newest segment; replay reads the oldest segment whole and
deletes it only after every record in it was acknowledged, so a crash during replay re-sends
that segment (the stream's ``Nats-Msg-Id`` deduplication drops what had already arrived).
``prepend`` writes a segment before all others: the publisher uses it on shutdown for events
that are older than everything on disk.

A torn last record (the process died mid-write) is skipped with a warning. Appends are flushed
to the OS at once and fsynced when a segment is sealed or the outbox is closed, so a process
crash loses nothing; a power loss can lose the writes of the last moments.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["Outbox", "OutboxRecord"]

_HEADER = struct.Struct(">I")
_SHORT = struct.Struct(">H")
_FIRST_SEGMENT = 10**15  # room to prepend below it
_SEGMENT_BYTES = 64 * 1024 * 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One message to publish: subject, ``Nats-Msg-Id`` and payload bytes."""

    subject: str
    msg_id: str
    payload: bytes

    def encode(self) -> bytes:
        subject, msg_id = self.subject.encode(), self.msg_id.encode()
        body = b"".join((_SHORT.pack(len(subject)), subject, _SHORT.pack(len(msg_id)), msg_id, self.payload))
        return _HEADER.pack(len(body)) + body


class Outbox:
    """Segmented, append-only, replayed oldest first. Not thread-safe; one owner."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._tail: BinaryIO | None = None
        self._tail_number: int | None = None
        self._tail_bytes = 0
        self._records = sum(len(self.read(p)) for p in self.segments())

    @property
    def directory(self) -> Path:
        """Where the segments live."""
        return self._dir

    def __len__(self) -> int:
        """Records on disk, not yet replayed."""
        return self._records

    def segments(self) -> list[Path]:
        """Segment files, oldest first."""
        return sorted(self._dir.glob("*.seg"))

    def append(self, records: Iterable[OutboxRecord]) -> int:
        """Write ``records`` after everything already here; returns how many."""
        count = 0
        for record in records:
            data = record.encode()
            tail = self._open_tail()
            tail.write(data)
            self._tail_bytes += len(data)
            count += 1
            if self._tail_bytes >= _SEGMENT_BYTES:
                self.seal()
        if self._tail is not None:
            self._tail.flush()
        self._records += count
        return count

    def prepend(self, records: list[OutboxRecord]) -> int:
        """Write ``records`` before everything already here (they are older); returns how many."""
        if not records:
            return 0
        existing = self.segments()
        number = int(existing[0].stem) - 1 if existing else _FIRST_SEGMENT
        path = self._dir / f"{number:020d}.seg"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            for record in records:
                f.write(record.encode())
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)
        self._records += len(records)
        return len(records)

    def oldest(self) -> tuple[Path, list[OutboxRecord]] | None:
        """The oldest segment and its records (sealing it first if it is being appended to)."""
        segments = self.segments()
        if not segments:
            return None
        if self._tail_number is not None and segments[0].stem == f"{self._tail_number:020d}":
            self.seal()
        return segments[0], self.read(segments[0])

    def expire(self, max_age_s: float) -> int:
        """Delete the sealed segments last written more than ``max_age_s`` ago, unsent: their events
        are older than the stream would keep them (retention). Returns how many events went."""
        cutoff = time.time() - max_age_s
        tail = f"{self._tail_number:020d}" if self._tail_number is not None else None
        dropped = 0
        for path in self.segments():
            if path.stem == tail or path.stat().st_mtime >= cutoff:
                continue
            count = len(self.read(path))
            path.unlink(missing_ok=True)
            self._records -= count
            dropped += count
            log.warning("outbox segment %s: %d events older than %g s deleted unsent (retention)",
                        path, count, max_age_s)  # fmt: skip
        return dropped

    def remove(self, path: Path, records: int) -> None:
        """Delete a replayed segment."""
        path.unlink(missing_ok=True)
        self._records -= records

    def seal(self) -> None:
        """Close the segment being appended to; the next append starts a new one."""
        if self._tail is not None:
            self._tail.flush()
            os.fsync(self._tail.fileno())
            self._tail.close()
        self._tail, self._tail_number, self._tail_bytes = None, None, 0

    def close(self) -> None:
        """Flush and close (idempotent)."""
        self.seal()

    @staticmethod
    def read(path: Path) -> list[OutboxRecord]:
        """Every whole record of a segment; a torn tail is skipped."""
        data = path.read_bytes()
        records, at = [], 0
        while at + _HEADER.size <= len(data):
            (length,) = _HEADER.unpack_from(data, at)
            body = data[at + _HEADER.size : at + _HEADER.size + length]
            if len(body) < length:
                break
            (n,) = _SHORT.unpack_from(body, 0)
            subject = body[2 : 2 + n].decode()
            (m,) = _SHORT.unpack_from(body, 2 + n)
            msg_id = body[4 + n : 4 + n + m].decode()
            records.append(OutboxRecord(subject, msg_id, body[4 + n + m :]))
            at += _HEADER.size + length
        if at != len(data):
            log.warning("outbox segment %s: skipped a torn record of %d bytes at its end", path, len(data) - at)
        return records

    def _open_tail(self) -> BinaryIO:
        if self._tail is None:
            existing = self.segments()
            self._tail_number = int(existing[-1].stem) + 1 if existing else _FIRST_SEGMENT
            self._tail = (self._dir / f"{self._tail_number:020d}.seg").open("ab")
            self._tail_bytes = 0
        return self._tail
