"""Subjects, the JetStream stream and the payload object store: names and idempotent provisioning.

Subjects (``prefix`` defaults to ``sg``)::

    sg.events.<tenant>.<session>.<kind>     durable events: the EVENTS stream stores these
    sg.live.<tenant>.<session>.turn.delta   coalesced token deltas: core NATS only, never stored

``<kind>`` is two tokens (``turn.completed``), so ``nats sub 'sg.events.*.*.turn.>'`` shows
every turn event, ``nats sub 'sg.events.*.sess42.>'`` one session, and
``nats sub 'sg.events.t1f2e3d4c5b6a7980.>'`` one tenant. Events that belong to no session
(``policy.updated``) use ``_`` for both tenant and session. A session id that is not a safe
subject token (``[A-Za-z0-9_-]{1,64}``) appears as a digest of itself; the event body always
carries the real id.

Provisioning never deletes anything: a missing stream or bucket is created, an existing one
whose managed settings differ is updated in place (what JetStream allows to change; a change it
refuses, such as the storage type, is reported with the server's message).

Who owns a setting: a :class:`StreamSpec` field left ``None`` (``replicas``, ``max_bytes``,
``max_age_s``) is one the caller does not own. A missing stream is created with the default (one
replica, no limits) and an existing one keeps its own. Components that only publish to or read
the events stream (``publish-weights``, the verl checkpoint engine, the consumers without
``--stream-replicas``) leave them ``None``, so that they never undo what the gateways
(``--stream-replicas``, ``--stream-max-bytes``, ...) set; a value given is enforced, on the stream
and on the replicas of its buckets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import anyio

from .events import Event, subject_token

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue
    from nats.js.object_store import ObjectStore

__all__ = [
    "MAX_REPLICAS",
    "PAYLOAD_OBJECT_HEADER",
    "StreamSpec",
    "delta_subject",
    "ensure_bucket",
    "ensure_key_value",
    "ensure_named_stream",
    "ensure_object_store",
    "ensure_stream",
    "event_subject",
    "keep_for",
]

# On a pointer message: "<bucket>/<object name>" of the event too large for one NATS message.
PAYLOAD_OBJECT_HEADER = "Sg-Payload-Object"

MAX_REPLICAS = 5
"""JetStream's most replicas of a stream: the top of every ``--stream-replicas``."""

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_LEADER_WAIT_S = 10.0  # after a change of replicas: a publish before the new leader would time out


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """Where durable events go and how long JetStream keeps them."""

    prefix: str = "sg"
    stream: str = "SG_EVENTS"
    payload_bucket: str = "sg_payloads"
    image_bucket: str = "sg_images"  # images by the SHA-256 of their bytes, and their processors (docs/images.md)
    # None: not this caller's to set; 1, -1 (unlimited) and 0 (forever) for a new stream (module docstring).
    replicas: int | None = None
    max_bytes: int | None = None
    max_age_s: float | None = None
    image_max_age_s: float | None = None  # the image bucket's (an image is stored again while in use)
    duplicate_window_s: float = 600.0  # how long a replayed event id is still recognised

    def __post_init__(self) -> None:
        if self.replicas is not None and not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas {self.replicas}: from 1 to {MAX_REPLICAS}")

    @property
    def subjects(self) -> list[str]:
        """The stream's subject filter."""
        return [f"{self.prefix}.events.>"]


def event_subject(prefix: str, event: Event) -> str:
    """The subject a durable ``event`` is published on."""
    if event.session_id is None:
        return f"{prefix}.events._._.{event.kind}"
    return f"{prefix}.events.{subject_token(event.tenant)}.{subject_token(event.session_id)}.{event.kind}"


def delta_subject(prefix: str, event: Event) -> str:
    """The subject a live ``turn.delta`` is published on."""
    return live_subject(prefix, event.tenant, event.session_id, event.kind)


def live_subject(prefix: str, tenant: str, session_id: str | None, kind: str = "turn.delta") -> str:
    """The subject a session's live events of ``kind`` are published on (what :func:`delta_subject` says)."""
    return f"{prefix}.live.{subject_token(tenant)}.{subject_token(session_id or '_')}.{kind}"


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> None:
    """Create the events stream, or bring an existing one's managed settings to ``spec``."""
    await ensure_named_stream(
        js,
        spec.stream,
        spec.subjects,
        replicas=spec.replicas,
        max_bytes=spec.max_bytes,
        max_age_s=spec.max_age_s,
        duplicate_window_s=spec.duplicate_window_s,
    )


async def ensure_named_stream(
    js: JetStreamContext,
    name: str,
    subjects: list[str],
    *,
    replicas: int | None = None,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
    duplicate_window_s: float = 600.0,
) -> None:
    """Create a file-backed limits stream, or bring an existing one's managed settings to these.

    ``replicas``, ``max_bytes``, ``max_age_s`` left ``None``: a new stream gets 1, unlimited and
    forever; an existing one keeps its own.
    """
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import BadRequestError, NotFoundError

    def config(replicas: int, max_bytes: int, max_age_s: float) -> StreamConfig:
        return StreamConfig(
            name=name,
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
            max_bytes=max_bytes,
            max_age=max_age_s,
            duplicate_window=duplicate_window_s,
        )

    try:
        info = await js.stream_info(name)
    except NotFoundError:
        try:
            await js.add_stream(config(_given(replicas, 1), _given(max_bytes, -1), _given(max_age_s, 0.0)))
        except BadRequestError:
            # Created meanwhile with other settings (``up`` starts the gateway, the assembler and
            # the batcher at once, each ensuring the streams it uses): bring it to ours below.
            info = await js.stream_info(name)
        else:
            log.info("created stream %s (%s)", name, ", ".join(subjects))
            return
    have = info.config
    wanted = config(
        _given(replicas, have.num_replicas or 1),
        _given(max_bytes, -1 if have.max_bytes is None else have.max_bytes),
        _given(max_age_s, have.max_age or 0.0),
    )
    managed = ("subjects", "num_replicas", "max_bytes", "max_age", "duplicate_window", "retention", "discard")
    if any(getattr(have, f) != getattr(wanted, f) for f in managed):
        await js.update_stream(wanted)
        log.info("updated stream %s to the configured settings", name)
        if have.num_replicas != wanted.num_replicas:
            await _wait_for_leader(js, name)


def _given(value: _T | None, otherwise: _T) -> _T:
    """``value``, unless it is ``None`` (a setting the caller leaves to whoever owns it)."""
    return otherwise if value is None else value


async def ensure_object_store(js: JetStreamContext, spec: StreamSpec) -> ObjectStore:
    """The bucket holding events too large for one message, created if missing."""
    return await ensure_bucket(
        js, spec.payload_bucket, replicas=spec.replicas, max_bytes=spec.max_bytes, max_age_s=spec.max_age_s
    )


async def ensure_bucket(
    js: JetStreamContext,
    bucket: str,
    *,
    replicas: int | None = None,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
) -> ObjectStore:
    """A file-backed object store bucket, created if missing.

    An existing bucket is used as it is, but for ``replicas`` and ``max_age_s`` when given: its
    stream is brought to them (``None``: one replica and no age limit for a new bucket; 0: none).
    ``max_bytes`` applies to a new one.
    """
    from nats.js.api import ObjectStoreConfig, StorageType
    from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

    try:
        store = await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        config = ObjectStoreConfig(
            bucket=bucket,
            storage=StorageType.FILE,
            replicas=_given(replicas, 1),
            max_bytes=_given(max_bytes, -1),
            ttl=max_age_s or None,
        )
        try:
            return await js.create_object_store(bucket, config=config)
        except BadRequestError:  # created meanwhile with other settings (see ensure_named_stream)
            store = await js.object_store(bucket)
    await _scale(js, f"OBJ_{bucket}", replicas, max_age_s)
    return store


async def ensure_key_value(
    js: JetStreamContext, bucket: str, *, replicas: int | None = None, history: int = 1
) -> KeyValue:
    """A file-backed key-value bucket, created if missing; ``replicas`` as :func:`ensure_bucket`'s."""
    from nats.js.api import KeyValueConfig, StorageType
    from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        config = KeyValueConfig(bucket=bucket, storage=StorageType.FILE, replicas=_given(replicas, 1), history=history)
        try:
            return await js.create_key_value(config=config)
        except BadRequestError:  # created meanwhile with other settings (see ensure_named_stream)
            kv = await js.key_value(bucket)
    await _scale(js, f"KV_{bucket}", replicas)
    return kv


async def keep_for(js: JetStreamContext, stream: str, max_age_s: float) -> None:
    """Bring an existing stream (or the stream behind a bucket: ``KV_<name>``, ``OBJ_<name>``) to
    keep messages ``max_age_s`` (0: forever), its other settings as they are (retention)."""
    await _scale(js, stream, None, max_age_s)


async def _scale(js: JetStreamContext, stream: str, replicas: int | None, max_age_s: float | None = None) -> None:
    """Bring the stream behind an existing bucket to ``replicas`` and ``max_age_s`` (``None``: leave
    it as it is; an age of 0: no limit)."""
    if replicas is None and max_age_s is None:
        return
    have = (await js.stream_info(stream)).config
    wanted = replace(have, num_replicas=_given(replicas, have.num_replicas), max_age=_given(max_age_s, have.max_age))
    if (wanted.num_replicas, wanted.max_age or 0.0) != (have.num_replicas, have.max_age or 0.0):
        await js.update_stream(wanted)
        log.info("updated stream %s to %d replicas, max age %g s", stream, wanted.num_replicas, wanted.max_age or 0)
        if wanted.num_replicas != have.num_replicas:
            await _wait_for_leader(js, stream)


async def _wait_for_leader(js: JetStreamContext, stream: str) -> None:
    """Wait (a few seconds at most) until ``stream``, just given a new number of replicas, has a leader.

    Its raft group is formed anew: until it elects a leader (half a second on a local cluster), a
    publish to it times out rather than waits.
    """
    with anyio.move_on_after(_LEADER_WAIT_S):
        for _ in range(int(_LEADER_WAIT_S / 0.1)):
            cluster = (await js.stream_info(stream)).cluster
            if cluster is None or cluster.leader is not None:
                return
            await anyio.sleep(0.1)  # nothing tells of an election but asking again
    log.warning("stream %s has no leader %g s after its replicas changed", stream, _LEADER_WAIT_S)
