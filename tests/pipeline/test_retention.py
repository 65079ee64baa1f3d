"""Retention (docs/data-rights.md): each store keeps data as long as its flag says, enforced by
the store where it can (JetStream ``max_age`` on streams and the streams behind buckets) and by
the component that owns the files otherwise (the gateway's outbox, the batcher's parquet files).
All against a real nats-server and real files."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import pytest

from consumers.batcher import remove_old_batch_files
from consumers.streams import ConsumerStreams, ensure_consumer_streams
from pipeline._outbox import Outbox, OutboxRecord
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import encode_event
from pipeline.publisher import EventPublisher, PublisherConfig
from pipeline.streams import StreamSpec, ensure_bucket, ensure_key_value, event_subject, keep_for

from ..support.events import turn_completed

DAY = 24 * 3600.0


@pytest.fixture
def server() -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as running:
        yield running


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _records(session: str, n: int) -> list[OutboxRecord]:
    out = []
    for seq in range(n):
        event = turn_completed(session, seq, turn_id=f"{session}-t{seq}")
        out.append(OutboxRecord(event_subject("sg", event), event.event_id, encode_event(event)))
    return out


def test_the_outbox_deletes_whole_segments_older_than_its_age_but_never_the_one_being_written(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    outbox.append(_records("old", 3))
    outbox.seal()
    outbox.append(_records("new", 2))  # the tail: being appended to
    old, tail = outbox.segments()
    _age(old, 2 * DAY)
    _age(tail, 2 * DAY)  # old too, but still open: its last records may be seconds old
    assert outbox.expire(DAY) == 3
    assert outbox.segments() == [tail] and len(outbox) == 2
    assert outbox.expire(0.001) == 0  # the tail stays until it is sealed
    outbox.close()


def test_a_publisher_never_replays_outbox_events_older_than_the_retention(server: EmbeddedNatsServer, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    outbox.append(_records("expired", 4))
    outbox.seal()
    outbox.append(_records("kept", 3))
    outbox.seal()
    outbox.close()
    _age(outbox.segments()[0], 31 * DAY)
    config = PublisherConfig(
        servers=(server.url,),
        outbox_dir=tmp_path / "outbox",
        stream=StreamSpec(max_age_s=30 * DAY),
        outbox_max_age_s=30 * DAY,
    )

    async def run() -> tuple[int, list[str]]:
        async with EventPublisher(config) as publisher:
            await publisher.wait_published()
            expired = publisher.statistics().expired
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            info = await js.stream_info("SG_EVENTS")
            assert info.config.max_age == 30 * DAY
            subjects = [(await js.get_msg("SG_EVENTS", s)).subject for s in range(1, info.state.last_seq + 1)]
        finally:
            await nc.close()
        return expired, subjects

    expired, subjects = anyio.run(run)
    assert expired == 4
    assert len(subjects) == 3 and all(".kept." in s for s in subjects), subjects


def test_streams_and_buckets_are_brought_to_their_retention_and_left_alone_without_one(
    server: EmbeddedNatsServer,
) -> None:
    async def run() -> dict[str, float]:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            names = ConsumerStreams()
            await ensure_consumer_streams(js, names)  # no retention given: everything kept
            await ensure_key_value(js, "sg_sessions_test")
            before = {s: (await js.stream_info(s)).config.max_age or 0.0
                      for s in ("SG_TRAJECTORIES", "SG_BATCHES", "OBJ_sg_batches")}  # fmt: skip
            assert set(before.values()) == {0.0}
            aged = ConsumerStreams(trajectories_max_age_s=30 * DAY, batches_max_age_s=14 * DAY)
            await ensure_consumer_streams(js, aged)  # an existing stream and bucket are brought to it
            await ensure_bucket(js, "sg_images", max_age_s=60 * DAY)  # a new bucket is created with it
            await keep_for(js, "KV_sg_sessions_test", 7 * DAY)
            await ensure_consumer_streams(js, names)  # unset again: left as they are
            return {s: (await js.stream_info(s)).config.max_age or 0.0 for s in (
                "SG_TRAJECTORIES", "SG_BATCHES", "OBJ_sg_batches", "OBJ_sg_images", "KV_sg_sessions_test")}  # fmt: skip
        finally:
            await nc.close()

    assert anyio.run(run) == {
        "SG_TRAJECTORIES": 30 * DAY,
        "SG_BATCHES": 14 * DAY,
        "OBJ_sg_batches": 14 * DAY,
        "OBJ_sg_images": 60 * DAY,
        "KV_sg_sessions_test": 7 * DAY,
    }


def test_an_image_in_use_is_stored_again_once_half_its_bucket_age_has_passed(
    server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    """Objects are written once and referred to by every later turn: under an age limit, one in
    use must be written again before it expires from under the turns that refer to it."""

    async def run(max_age_s: float | None) -> int:
        spec = StreamSpec(image_bucket=f"img{int(max_age_s or 0)}", image_max_age_s=max_age_s)
        config = PublisherConfig(servers=(server.url,), outbox_dir=tmp_path / f"o{max_age_s}", stream=spec)
        async with EventPublisher(config) as publisher:
            publisher.put_object_nowait("images/abc", b"pixels")
            await publisher.wait_published()
            await anyio.sleep(1.2)  # past half of a 2 s limit
            publisher.put_object_nowait("images/abc", b"pixels")
            await publisher.wait_published()
            return publisher.statistics().objects

    assert anyio.run(run, 2.0) == 2
    assert anyio.run(run, None) == 1  # no limit: written once


def test_the_batcher_removes_only_its_old_parquet_files(tmp_path: Path) -> None:
    old, new, other = tmp_path / "b1.parquet", tmp_path / "b2.parquet", tmp_path / "notes.txt"
    for path in (old, new, other):
        path.write_bytes(b"x")
    _age(old, 31 * DAY)
    _age(other, 31 * DAY)
    assert remove_old_batch_files(tmp_path, 30 * DAY) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b2.parquet", "notes.txt"]
