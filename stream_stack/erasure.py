"""Erasure: ``stream-gateway forget`` deletes a session's (or a whole tenant's) captured data from
every store, and keeps it from coming back (docs/data-rights.md).

In order, each step idempotent, so that a forget cut short (NATS gone mid-way) is finished by
running it again:

1. **Tombstone** (:mod:`pipeline.tombstones`): from now on no gateway publishes an event of it
   (from memory, or from an outbox replayed later), gateways drop it from their caches, and a
   grace period lets them learn it before anything is deleted.
2. **Read what it left**, before deleting: its events (sessions, the policy versions that sampled
   it, the images its turns showed, oversized payloads) and its trajectories (their ids).
3. **Purge** by subject: the events (``sg.events.<tenant>.<session>.>``), the trajectories
   (``sg.trajectories.<tenant>.<session>``); their oversized payloads; the shared session
   records, close markers and turn index entries; the assembler's state; the reward worker's
   scores (``$KV.sg_scores.<tenant>.<session>.>``). Stream purges, not
   deletes: a key-value delete would leave a marker named after the session.
4. **Images** its turns showed that no remaining event refers to (a scan of the other turns'
   events, only when it had images).
5. **Batches** holding its trajectories: rewritten without the groups that held them (a batch is
   whole groups), or removed when nothing is left; manifest and parquet object alike; parquet
   files on disk in the directories given (a batcher's ``--output-dir``).
6. **A second sweep** of the subjects after the grace period, for what a gateway wrote in the
   moment before it learned the tombstone.
7. **The receipt**: counts per store and what cannot be undone (the policy versions that sampled
   it, the batches already handed to training), returned and published on ``sg.audit.forget``
   (stream ``SG_AUDIT``), naming the tombstone, never the session or tenant.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson

from consumers.batch_record import batch_id_of
from consumers.streams import ConsumerStreams
from pipeline.events import subject_token, tenant_id
from pipeline.streams import PAYLOAD_OBJECT_HEADER, ensure_named_stream
from pipeline.tombstones import FORGOTTEN_BUCKET, session_tombstone, tenant_tombstone, write_tombstone

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

__all__ = [
    "AUDIT_STREAM", "ErasureTarget", "Receipt", "find_session_tenants", "forget", "rewrite_batch_files", "tenant_token",
]  # fmt: skip

log = logging.getLogger(__name__)

AUDIT_STREAM = "SG_AUDIT"
_GRACE_S = 1.0  # for every gateway to learn a tombstone before the purge, and between the sweeps
_TIMEOUT_S = 10.0  # one JetStream API request


@dataclass(frozen=True, slots=True)
class ErasureTarget:
    """What to forget: one session of a tenant (``session_id``), or every session of the tenant.

    ``tenant_token``: the tenant's token in the events' subjects (:func:`tenant_token` of its name;
    :func:`find_session_tenants` for a session named without its tenant)."""

    tenant_token: str
    session_id: str | None = None
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    sessions_bucket: str = "sg_sessions"
    batch_dirs: tuple[Path, ...] = ()  # parquet files on this machine (a batcher's --output-dir)
    grace_s: float = _GRACE_S
    before: float | None = None  # only the sessions that began before this time (Unix seconds), whole

    @property
    def tombstone(self) -> str:
        if self.session_id is None:
            return tenant_tombstone(self.tenant_token)
        return session_tombstone(self.tenant_token, subject_token(self.session_id))

    @property
    def scope(self) -> str:
        """The subject tokens after the tenant's: one session's, or any."""
        return subject_token(self.session_id) if self.session_id is not None else "*"


@dataclass(slots=True)
class Receipt:
    """What a forget deleted, per store, and what it cannot undo."""

    tombstone: str
    what: str  # "session" or "tenant"
    before: float | None = None  # only sessions begun before (Unix seconds), each under its own tombstone
    sessions: int = 0
    events: int = 0
    trajectories: int = 0
    payload_objects: int = 0
    session_records: int = 0  # records, close markers and turn index entries of the shared sessions
    assembler_states: int = 0
    scores: int = 0  # the reward worker's records (a judge's answer quotes the session)
    images: int = 0
    batches_rewritten: int = 0
    batches_removed: int = 0
    batch_rows_removed: int = 0
    parquet_files_rewritten: int = 0
    parquet_files_removed: int = 0
    # What cannot be undone: weights already trained on the data.
    sampled_by_policy_versions: list[int] = field(default_factory=list)
    batches_handed_to_training: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    complete: bool = False
    steps_done: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tenant_token(tenant: str) -> str:
    """A tenant's token in the events' subjects, from its name (its key file name, or its key)."""
    return subject_token(tenant_id(tenant))


async def find_session_tenants(nc: Client, session_id: str, names: ConsumerStreams | None = None) -> list[str]:
    """The tokens of the tenants holding events of a session ``session_id`` (ids are the tenant's
    own: two tenants may use one)."""
    names = names or ConsumerStreams()
    subject = f"{names.prefix}.events.*.{subject_token(session_id)}.>"
    request = orjson.dumps({"subjects_filter": subject})
    reply = orjson.loads((await nc.request(f"$JS.API.STREAM.INFO.{names.events}", request, timeout=_TIMEOUT_S)).data)
    if "error" in reply:
        if reply["error"].get("err_code") == 10059:
            return []
        raise RuntimeError(f"stream {names.events}: {reply['error'].get('description')}")
    subjects = (reply.get("state") or {}).get("subjects") or {}
    return sorted({subject.split(".")[2] for subject in subjects})


async def forget(nc: Client, target: ErasureTarget, say: Callable[[str], None] | None = None) -> Receipt:
    """Erase ``target`` everywhere (module docstring); the receipt. NATS errors propagate, with the
    steps done so far in ``Receipt.steps_done`` of the receipt attached as ``exc.receipt``."""
    js = nc.jetstream(timeout=_TIMEOUT_S)
    receipt = Receipt(target.tombstone, "session" if target.session_id is not None else "tenant", target.before)
    started = time.monotonic()
    note = say or (lambda _: None)
    try:
        await _erase(nc, js, target, receipt, note)
    except Exception as exc:
        exc.receipt = receipt  # type: ignore[attr-defined]
        raise
    receipt.seconds = round(time.monotonic() - started, 3)
    receipt.complete = True
    await _audit(js, target, receipt)
    return receipt


async def _erase(
    nc: Client, js: JetStreamContext, target: ErasureTarget, receipt: Receipt, note: Callable[[str], None]
) -> None:
    names, tenant = target.names, target.tenant_token
    # Whole sessions, each under its own tombstone; or, without ``before``, the target's one tombstone.
    scopes = [target.scope] if target.before is None else await _sessions_begun_before(js, target)
    tombstones = [target.tombstone] if target.before is None else [session_tombstone(tenant, scope) for scope in scopes]
    for key in tombstones:
        await write_tombstone(js, key, "session" if key.startswith("s.") else "tenant", FORGOTTEN_BUCKET)
    receipt.steps_done.append("tombstone")
    note(f"{len(tombstones)} tombstones written; {target.grace_s:g} s for the gateways to learn them")
    await anyio.sleep(target.grace_s)

    seen, trajectory_ids, trajectory_objects = _Seen(), [], set()
    for scope in scopes:
        await _read_events(nc, js, names.events, f"{names.prefix}.events.{tenant}.{scope}.>", seen)
        subject = f"{names.prefix}.trajectories.{tenant}.{scope}"
        ids, objects = await _read_trajectories(nc, js, names.trajectories, subject)
        trajectory_ids += ids
        trajectory_objects |= objects
    receipt.sessions = len(seen.sessions)
    receipt.sampled_by_policy_versions = sorted(seen.policy_versions)
    receipt.steps_done.append("read")
    note(f"{len(seen.sessions)} sessions: {seen.count} events, {len(trajectory_ids)} trajectories")

    async def sweep() -> None:
        for scope in scopes:
            receipt.events += await _purge(nc, names.events, f"{names.prefix}.events.{tenant}.{scope}.>")
            subject = f"{names.prefix}.trajectories.{tenant}.{scope}"
            receipt.trajectories += await _purge(nc, names.trajectories, subject)
            state = f"$KV.{names.state_bucket}.s.{tenant}.{scope}"
            receipt.assembler_states += await _purge(nc, f"KV_{names.state_bucket}", state)
            scores = f"$KV.{names.score_bucket}.{tenant}.{scope}.>"
            receipt.scores += await _purge(nc, f"KV_{names.score_bucket}", scores)
        receipt.session_records += await _purge_sessions(nc, js, target, seen.sessions, whole_tenant=scopes == ["*"])

    await sweep()
    for name in sorted(seen.payload_objects | trajectory_objects):
        receipt.payload_objects += await _purge_object(nc, js, names.payload_bucket, name)
    receipt.steps_done.append("purged")
    if seen.images:
        receipt.images = await _purge_unused_images(nc, js, names, seen.images)
    receipt.steps_done.append("images")
    await _rewrite_batches(nc, js, names, set(trajectory_ids), receipt)
    for directory in target.batch_dirs:
        rewritten, removed = await anyio.to_thread.run_sync(rewrite_batch_files, directory, set(trajectory_ids))
        receipt.parquet_files_rewritten += rewritten
        receipt.parquet_files_removed += removed
    receipt.steps_done.append("batches")
    await anyio.sleep(target.grace_s)
    await sweep()  # what a gateway wrote in the moment before it learned the tombstone
    receipt.steps_done.append("second sweep")


@dataclass(slots=True)
class _Seen:
    count: int = 0
    sessions: set[str] = field(default_factory=set)
    policy_versions: set[int] = field(default_factory=set)
    images: set[str] = field(default_factory=set)
    payload_objects: set[str] = field(default_factory=set)


async def _messages(js: JetStreamContext, stream: str, subject: str) -> list[Any]:
    """Every message of ``stream`` on ``subject`` (an ephemeral, unacknowledged consumer)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        info = await js.add_consumer(stream, config=config)
    except Exception as exc:
        if "stream not found" in str(exc):
            return []
        raise
    out: list[Any] = []
    remaining = info.num_pending or 0
    sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    try:
        while remaining > 0:
            batch = await sub.fetch(min(remaining, 512), timeout=_TIMEOUT_S)
            remaining -= len(batch)
            out.extend(batch)
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(stream, info.name)
    return out


async def _sessions_begun_before(js: JetStreamContext, target: ErasureTarget) -> list[str]:
    """The subject tokens of the target's sessions whose first event is older than ``target.before``."""
    names, first = target.names, dict[str, float]()
    for msg in await _messages(js, names.events, f"{names.prefix}.events.{target.tenant_token}.{target.scope}.>"):
        token = msg.subject.split(".")[3]
        stamp = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp is not None else 0.0
        first[token] = min(first.get(token, stamp), stamp)
    assert target.before is not None
    return sorted(token for token, stamp in first.items() if stamp < target.before)


async def _read_events(nc: Client, js: JetStreamContext, stream: str, subject: str, seen: _Seen) -> None:
    from pipeline.subscriber import message_payload

    for msg in await _messages(js, stream, subject):
        seen.count += 1
        ref = (msg.headers or {}).get(PAYLOAD_OBJECT_HEADER)
        if ref is not None:
            seen.payload_objects.add(ref.partition("/")[2])
        try:
            body = orjson.loads(await message_payload(msg, js))
        except (orjson.JSONDecodeError, LookupError):
            continue  # its payload object is gone already: nothing more to learn from it
        if body.get("session_id"):
            seen.sessions.add(str(body["session_id"]))
        if body.get("kind") in ("turn.completed", "turn.aborted"):
            seen.policy_versions.add(int(body.get("policy_version") or 0))
            for start, _ in body.get("policy_versions") or ():
                seen.policy_versions.add(int(start))
            seen.images.update(str(image["sha256"]) for image in body.get("images") or ())


async def _read_trajectories(nc: Client, js: JetStreamContext, stream: str, subject: str) -> tuple[list[str], set[str]]:
    ids, objects = [], set()
    for msg in await _messages(js, stream, subject):
        ids.append(str((msg.headers or {}).get("Nats-Msg-Id") or ""))
        ref = (msg.headers or {}).get(PAYLOAD_OBJECT_HEADER)
        if ref is not None:
            objects.add(ref.partition("/")[2])
    return [i for i in ids if i], objects


async def _purge(nc: Client, stream: str, subject: str) -> int:
    """Purge ``subject`` from ``stream``; how many messages went (a missing stream: none)."""
    request = orjson.dumps({"filter": subject})
    reply = await nc.request(f"$JS.API.STREAM.PURGE.{stream}", request, timeout=_TIMEOUT_S)
    body = orjson.loads(reply.data)
    if "error" in body:
        if body["error"].get("err_code") == 10059:  # stream not found
            return 0
        raise RuntimeError(f"purge of {subject} from {stream}: {body['error'].get('description')}")
    return int(body.get("purged", 0))


async def _purge_sessions(
    nc: Client, js: JetStreamContext, target: ErasureTarget, sessions: Iterable[str], *, whole_tenant: bool
) -> int:
    """The shared session records, close markers and turn index entries.

    Records and close markers live under their tenant (``s.<tenant>.<session>``, ``c.<tenant>.<session>``:
    a session id is a name within its tenant); a record of the layout before that (``s.<session>``) is
    purged only when this tenant owns it, since another tenant may use the same id.
    """
    from stream_gateway.sessions import SessionRecord

    bucket, stream = target.sessions_bucket, f"KV_{target.sessions_bucket}"
    owner = target.tenant_token  # the index's tenant digest is a safe token: itself
    purged = 0
    if whole_tenant:
        for prefix in ("k", "s", "c"):
            purged += await _purge(nc, stream, f"$KV.{bucket}.{prefix}.{owner}.>")

    async def record(subject: str) -> SessionRecord | None:
        try:
            message = await js.get_last_msg(stream, subject)
        except Exception:  # no record (never shared, or gone)
            return None
        return SessionRecord.from_json(orjson.loads(message.data)) if message.data else None

    for session_id in sessions:
        token = subject_token(session_id)
        current = await record(f"$KV.{bucket}.s.{owner}.{token}")
        legacy = await record(f"$KV.{bucket}.s.{token}")
        legacy_ours = legacy is not None and subject_token(legacy.tenant) == owner
        if not whole_tenant:  # its index entries, named by its turns' conversation keys
            for found in (current, legacy if legacy_ours else None):
                for entry in found.turns.values() if found is not None else ():
                    if entry.key:
                        purged += await _purge(nc, stream, f"$KV.{bucket}.k.{owner}.{entry.key.hex()}")
            purged += await _purge(nc, stream, f"$KV.{bucket}.s.{owner}.{token}")
            purged += await _purge(nc, stream, f"$KV.{bucket}.c.{owner}.{token}")
        if legacy_ours:
            purged += await _purge(nc, stream, f"$KV.{bucket}.s.{token}")
            purged += await _purge(nc, stream, f"$KV.{bucket}.c.{token}")
    return purged


async def _purge_object(nc: Client, js: JetStreamContext, bucket: str, name: str) -> int:
    """Remove object ``name`` (meta and chunks) without the delete marker that would name it."""
    try:
        store = await js.object_store(bucket)
        info = await store.get_info(name, show_deleted=True)
    except Exception:  # no such bucket or object: nothing to remove
        return 0
    meta = base64.urlsafe_b64encode(name.encode()).decode()
    await _purge(nc, f"OBJ_{bucket}", f"$O.{bucket}.C.{info.nuid}")
    return 1 if await _purge(nc, f"OBJ_{bucket}", f"$O.{bucket}.M.{meta}") else 0


async def _purge_unused_images(nc: Client, js: JetStreamContext, names: ConsumerStreams, images: set[str]) -> int:
    """The ``images`` no remaining turn event refers to."""
    still_used: set[str] = set()
    for kind in ("turn.completed", "turn.aborted"):
        for msg in await _messages(js, names.events, f"{names.prefix}.events.*.*.{kind}"):
            data = bytes(msg.data or b"")
            still_used.update(sha for sha in images if sha.encode() in data)
    removed = 0
    for sha in sorted(images - still_used):
        removed += await _purge_object(nc, js, names.image_bucket, f"images/{sha}")
    return removed


async def _rewrite_batches(
    nc: Client, js: JetStreamContext, names: ConsumerStreams, forgotten: set[str], receipt: Receipt
) -> None:
    """Every batch manifest naming a forgotten trajectory: its batch without the groups that held
    them, as a new batch (manifest and object), or nothing when none is left; the old ones purged."""
    from consumers.parquet import BatchManifest, decode_batch, encode_batch

    if not forgotten:
        return
    for msg in await _messages(js, names.batches, names.batch_subject):
        manifest = BatchManifest.model_validate_json(msg.data)
        hit = forgotten.intersection(manifest.trajectory_ids)
        if not hit:
            continue
        receipt.batches_handed_to_training.append(
            {
                "batch_id": manifest.batch_id,
                "policy_versions": [manifest.min_policy_version, manifest.max_policy_version],
            }
        )
        store = await js.object_store(manifest.bucket)
        trajectories, uids = decode_batch(bytes((await store.get(manifest.object)).data or b""))
        kept, kept_uids = _without_groups(trajectories, uids, hit)
        receipt.batch_rows_removed += len(trajectories) - len(kept)
        if kept:
            new_id = batch_id_of(t.trajectory_id for t in kept)
            data = encode_batch(kept, kept_uids, batch_id=new_id, prompt_length=manifest.prompt_length,
                                response_length=manifest.response_length)  # fmt: skip
            new = manifest.model_copy(
                update={
                    "batch_id": new_id,
                    "object": f"{new_id}.parquet",
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "groups": list(dict.fromkeys(kept_uids)),
                    "trajectory_ids": [t.trajectory_id for t in kept],
                    "min_policy_version": min(t.min_policy_version for t in kept),
                    "max_policy_version": max(t.max_policy_version for t in kept),
                }
            )
            await store.put(new.object, data)
            await js.publish(names.batch_subject, new.encode(), headers={"Nats-Msg-Id": new_id})
            receipt.batches_rewritten += 1
        else:
            receipt.batches_removed += 1
        await js.delete_msg(names.batches, msg.metadata.sequence.stream)
        await _purge_object(nc, js, manifest.bucket, manifest.object)


def _without_groups(trajectories: list[Any], uids: list[str], hit: set[str]) -> tuple[list[Any], list[str]]:
    """A batch's rows less every group (rows sharing a uid) holding a ``hit`` trajectory."""
    dropped = {u for t, u in zip(trajectories, uids, strict=True) if t.trajectory_id in hit}
    rows = [(t, u) for t, u in zip(trajectories, uids, strict=True) if u not in dropped]
    return [t for t, _ in rows], [u for _, u in rows]


def rewrite_batch_files(directory: Path, forgotten: set[str]) -> tuple[int, int]:
    """The parquet batch files in ``directory`` holding any of the ``forgotten`` trajectories:
    rewritten without the groups that held them (named by their new batch id), or removed when
    nothing is left. Returns (rewritten, removed)."""
    import pyarrow.parquet as pq

    from consumers.parquet import decode_batch, encode_batch

    rewritten = removed = 0
    if not forgotten or not directory.is_dir():
        return 0, 0
    for path in sorted(directory.glob("*.parquet")):
        data = path.read_bytes()
        trajectories, uids = decode_batch(data)
        hit = forgotten.intersection(t.trajectory_id for t in trajectories)
        if not hit:
            continue
        kept, kept_uids = _without_groups(trajectories, uids, hit)
        if kept:
            meta = pq.read_schema(io.BytesIO(data)).metadata or {}
            new_id = batch_id_of(t.trajectory_id for t in kept)
            rewritten_data = encode_batch(
                kept,
                kept_uids,
                batch_id=new_id,
                prompt_length=int(meta.get(b"sg.prompt_length", b"0")),
                response_length=int(meta.get(b"sg.response_length", b"0")),
            )
            tmp = directory / f".{new_id}.parquet.tmp"
            tmp.write_bytes(rewritten_data)
            tmp.rename(directory / f"{new_id}.parquet")
            rewritten += 1
        else:
            removed += 1
        path.unlink(missing_ok=True)
    return rewritten, removed


async def _audit(js: JetStreamContext, target: ErasureTarget, receipt: Receipt) -> None:
    """The receipt on ``sg.audit.forget`` (names the tombstone, never the session or tenant)."""
    subject = f"{target.names.prefix}.audit.forget"
    await ensure_named_stream(js, AUDIT_STREAM, [f"{target.names.prefix}.audit.>"])
    await js.publish(subject, orjson.dumps({**receipt.to_json(), "at": time.time()}))
