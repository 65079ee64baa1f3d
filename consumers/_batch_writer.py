"""Writing a batch: its record in the KV bucket, its parquet object, its manifest, its file.

:class:`BatchWriter` is the batcher's I/O for one batch, in the order the exactly-once argument of
:mod:`consumers.batch_record` needs: :meth:`~BatchWriter.commit` writes the index entries and then
the record (the commit point); :meth:`~BatchWriter.publish` stores the parquet object, announces
the manifest, writes the optional file and marks the record published; :meth:`~BatchWriter.write`
does both, retrying until they are done. :meth:`~BatchWriter.binding` is the lookup that tells a
redelivered trajectory's batch.

Deliberate choices:

* **The manifest is announced at most once**, twice over: JetStream drops a repeated
  ``Nats-Msg-Id`` within the stream's duplicate window, and a batch being recovered (or retried)
  first looks for its own manifest among the messages after the sequence its record noted, at
  most the last 10,000, so a recovery after the window does not announce it again. The object is
  only rewritten while no manifest points at it.
* Storing the object has a time limit of its own (60 s): a batch is megabytes, and a stalled
  object store must surface as a retried error, not a hung batcher.
* The file is written under a temporary name, flushed, synced and renamed, so a reader of the
  directory never sees half a batch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import orjson
from pipeline.durable import publish_durable
from pipeline.events import subject_token
from pipeline.streams import ensure_key_value

from .batch_record import BatchRecord
from .parquet import BatchManifest, encode_batch
from .streams import ConsumerStreams
from .trajectory import Trajectory, has_logprob

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["BatchWriter", "open_state_bucket"]

_OBJECT_TIMEOUT_S = 60.0
_MANIFEST_SCAN_LIMIT = 10_000
_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 10.0


async def open_state_bucket(js: JetStreamContext, bucket: str, replicas: int | None) -> KeyValue:
    """The KV bucket of batch records, created (file storage, history 1) if missing.

    ``replicas``: as :class:`~consumers.streams.ConsumerStreams`' (``None``: one for a new bucket,
    an existing one's count kept).
    """
    return await ensure_key_value(js, bucket, replicas=replicas, history=1)


class BatchWriter:
    """One connection's view of where batches go (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        kv: KeyValue,
        *,
        names: ConsumerStreams,
        output_dir: Path | None,
        log: logging.Logger,
    ) -> None:
        self._log = log  # the batcher's: its records keep their logger name
        self._nc = nc
        self._js = js
        self._kv = kv
        self._names = names
        self._output_dir = output_dir

    async def write(self, record: BatchRecord, trajectories: Sequence[Trajectory], *, recovered: bool) -> None:
        """Commit (unless ``recovered``: committed by a previous process) and publish, until done.

        NATS errors and timeouts are retried with a growing pause; a retry looks for the manifest
        first, as a recovery does, since the failed attempt may have announced it.
        """
        import nats.errors

        committed = recovered
        delay = _RETRY_FIRST_S
        attempt = 0
        while True:
            try:
                if not committed:
                    record = await self.commit(record)
                    committed = True
                await self.publish(record, trajectories, look_for_manifest=recovered or attempt > 0)
                return
            except (nats.errors.Error, TimeoutError) as exc:
                attempt += 1
                self._log.warning(
                    "batcher: writing batch %s failed (%r); retrying in %.1f s", record.batch_id, exc, delay
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)

    async def binding(self, tid: str) -> BatchRecord | None:
        """The record of the batch ``tid`` is bound to in the bucket, if any."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self._kv.get(f"t.{subject_token(tid)}")
            batch_id = (entry.value or b"").decode()
            record_entry = await self._kv.get(f"b.{batch_id}")
        except KeyNotFoundError:
            return None
        data = orjson.loads(record_entry.value or b"{}")
        if tid not in data.get("members", ()):
            return None
        return BatchRecord.from_dict(data)

    async def commit(self, record: BatchRecord) -> BatchRecord:
        """Write the index, then the record (the commit point); the record as written."""
        info = await self._js.stream_info(self._names.batches)
        record = record.committed(info.state.last_seq)
        for tid in record.members:  # the index first, the record (the commit point) last
            await self._kv.put(f"t.{subject_token(tid)}", record.batch_id.encode())
        await self._kv.put(f"b.{record.batch_id}", record.encode())
        return record

    async def publish(
        self, record: BatchRecord, trajectories: Sequence[Trajectory], *, look_for_manifest: bool
    ) -> None:
        """Object, manifest (unless ``look_for_manifest`` finds it out already), file, ``published``."""
        names = self._names
        data = encode_batch(
            list(trajectories),
            list(record.uids),
            batch_id=record.batch_id,
            prompt_length=record.prompt_length,
            response_length=record.response_length,
        )
        object_name = f"{record.batch_id}.parquet"
        if look_for_manifest and await self._manifest_published(record):
            self._log.info("batcher: batch %s was announced before a restart; not announcing it again", record.batch_id)
        else:
            with anyio.fail_after(_OBJECT_TIMEOUT_S):
                store = await self._js.object_store(names.batch_bucket)
                await store.put(object_name, data)
            manifest = _manifest(record, names.batch_bucket, object_name, data, trajectories)
            await publish_durable(
                self._nc, self._js, names.batch_subject, record.batch_id, manifest.encode(), bucket=names.payload_bucket
            )
        if self._output_dir is not None:
            await anyio.to_thread.run_sync(_write_atomically, self._output_dir / object_name, data)
        await self._kv.put(f"b.{record.batch_id}", record.published().encode())

    async def record_late_reward(self, batch_id: str, trajectory: Trajectory) -> None:
        """A reward that arrived after ``trajectory`` went into the published batch ``batch_id``:
        kept in the bucket as ``l.<batch id>.<trajectory>`` (the newest revision), never dropped."""
        late = {
            "batch_id": batch_id, "trajectory_id": trajectory.trajectory_id, "revision": trajectory.revision,
            "reward": trajectory.reward, "reward_source": trajectory.reward_source,
            "turn_rewards": {s.turn_id: s.reward for s in trajectory.turns if s.reward is not None},
            "recorded_at": time.time(),
        }  # fmt: skip
        await self._kv.put(f"l.{batch_id}.{subject_token(trajectory.trajectory_id)}", orjson.dumps(late))

    async def record_drops(self, drops: Sequence[tuple[str, str]]) -> None:
        """Why trajectories were left out of every batch: ``d.<trajectory>`` in the bucket, each
        ``{trajectory_id, reason, at}`` (the console shows it; a later revision may still be batched)."""
        now = time.time()
        for tid, reason in drops:
            record = {"trajectory_id": tid, "reason": reason, "at": now}
            await self._kv.put(f"d.{subject_token(tid)}", orjson.dumps(record))

    async def _manifest_published(self, record: BatchRecord) -> bool:
        """Whether a manifest with this batch's id is on the stream after the record's sequence."""
        from nats.js.errors import NotFoundError

        stream = self._names.batches
        last = (await self._js.stream_info(stream)).state.last_seq
        first = int(record.batches_last_seq or 0) + 1
        for seq in range(max(first, last - _MANIFEST_SCAN_LIMIT), last + 1):
            try:
                raw = await self._js.get_msg(stream, seq)
            except NotFoundError:
                continue
            if (raw.headers or {}).get("Nats-Msg-Id") == record.batch_id:
                return True
        return False


def _manifest(
    record: BatchRecord, bucket: str, object_name: str, data: bytes, trajectories: Sequence[Trajectory]
) -> BatchManifest:
    newest = max(t.max_policy_version for t in trajectories)
    return BatchManifest(
        batch_id=record.batch_id,
        bucket=bucket,
        object=object_name,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        group_size=record.group_size,
        groups=list(dict.fromkeys(record.uids)),
        trajectory_ids=list(record.members),
        min_policy_version=min(t.min_policy_version for t in trajectories),
        max_policy_version=newest,
        prompt_length=record.prompt_length,
        response_length=record.response_length,
        created_at=record.created_at,
        adapter=record.adapter,
        logprob_coverage=[logprob_coverage(t) for t in trajectories],
        version_lag=[newest - t.min_policy_version for t in trajectories],
    )


def logprob_coverage(trajectory: Trajectory) -> float:
    """The fraction of a trajectory's sampled ids (its turns' spans) with a finite recorded logprob."""
    sampled = [trajectory.logprobs[p] for turn in trajectory.turns
               for p in range(turn.start, min(turn.start + turn.length, len(trajectory.logprobs)))]  # fmt: skip
    return sum(has_logprob(v) for v in sampled) / len(sampled) if sampled else 1.0


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
