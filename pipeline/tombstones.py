"""Tombstones: the sessions and tenants whose data was erased (``stream-gateway forget``).

Erasure purges what the stores hold; a tombstone keeps it from coming back. Every component that
could write a forgotten session's data again obeys them: a gateway's publisher never publishes
an event of a forgotten session (from its memory, or from an outbox replayed long after the
forget, by a replica that was down during it), and drops the session from its cache; the
consumers drop what they hold of it.

A tombstone is a key of the key-value bucket ``sg_forgotten``, named by a digest, never by the
session's id or the tenant's name (a scan of the stores after a forget finds neither)::

    s.<digest of "<tenant token>.<session token>">    one session
    t.<digest of "<tenant token>">                    a whole tenant

where the tokens are those of the events' subjects (``sg.events.<tenant token>.<session
token>.<kind>``, :func:`pipeline.events.subject_token` of the tenant's digest and the session id),
so that a subject alone says whether its event is forgotten. The value is JSON: when, and what
(``{"at": ..., "what": "session" | "tenant"}``). Tombstones are never deleted.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

import anyio
import orjson

from .events import subject_token, tenant_id

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["FORGOTTEN_BUCKET", "Tombstones", "forgets", "session_tombstone", "tenant_tombstone", "tokens",
           "write_tombstone"]  # fmt: skip

FORGOTTEN_BUCKET = "sg_forgotten"

log = logging.getLogger(__name__)

_RETRY_S = 1.0


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def session_tombstone(tenant_token: str, session_token: str) -> str:
    """The key of one session's tombstone, from its subject tokens."""
    return f"s.{_digest(f'{tenant_token}.{session_token}')}"


def tenant_tombstone(tenant_token: str) -> str:
    """The key of a tenant's tombstone, from its subject token."""
    return f"t.{_digest(tenant_token)}"


def forgets(keys: Container[str], tenant_token: str, session_token: str) -> bool:
    """Whether ``keys`` hold a tombstone of that session or of its whole tenant (subject tokens)."""
    return tenant_tombstone(tenant_token) in keys or session_tombstone(tenant_token, session_token) in keys


def tokens(tenant: str, session_id: str | None = None) -> tuple[str, str | None]:
    """The subject tokens of a tenant (by name) and, if given, of its session."""
    return subject_token(tenant_id(tenant)), subject_token(session_id) if session_id is not None else None


class Tombstones:
    """What this process knows to be forgotten, kept current by a watch of the bucket.

    ``blocks(subject)`` answers for an event's subject in microseconds (two set lookups);
    ``on_forgotten(key)`` is called for every tombstone learned after the first load (a gateway
    drops the session from its cache).
    """

    def __init__(self, prefix: str = "sg", bucket: str = FORGOTTEN_BUCKET, replicas: int | None = None) -> None:
        """``replicas``: of the bucket, as the events stream's (``None``: one for a new bucket, an
        existing one as it is), so that it is there whenever the events are."""
        self._prefix = f"{prefix}.events."
        self._bucket = bucket
        self._replicas = replicas
        self._keys: set[str] = set()
        self._loaded = False
        self._seen = 0  # the bucket's stream sequence this copy is current to
        self._checked = -float("inf")  # when (monotonic) that was last confirmed
        self.on_forgotten: Callable[[str], object] | None = None

    @property
    def loaded(self) -> bool:
        """Whether the bucket was read at least once (until then nothing is known to be forgotten)."""
        return self._loaded

    def blocks(self, subject: str) -> bool:
        """Whether the event published on ``subject`` belongs to a forgotten session or tenant."""
        if not self._keys or not subject.startswith(self._prefix):
            return False
        parts = subject.split(".", 5)
        if len(parts) < 5:
            return False
        return forgets(self._keys, parts[2], parts[3])

    def forgets(self, tenant_token: str, session_token: str) -> bool:
        """Whether that session (or its whole tenant) is forgotten, by its subject tokens."""
        return bool(self._keys) and forgets(self._keys, tenant_token, session_token)

    def add(self, key: str) -> None:
        if key in self._keys:
            return
        self._keys.add(key)
        if self._loaded and self.on_forgotten is not None:
            self.on_forgotten(key)

    async def bucket(self, js: JetStreamContext) -> KeyValue:
        """The tombstones' bucket, created if missing."""
        from .streams import ensure_key_value

        return await ensure_key_value(js, self._bucket, replicas=self._replicas)

    async def load(self, js: JetStreamContext) -> None:
        """Read every tombstone (a publisher does before it replays its outbox)."""
        from .kv import current_keys

        kv = await self.bucket(js)
        last = (await js.stream_info(f"KV_{self._bucket}")).state.last_seq
        for key in await current_keys(kv):  # not kv.keys(): it can answer "none" too early (pipeline/kv.py)
            self.add(key)
        self._loaded = True
        self._seen = max(self._seen, last)
        self._checked = time.monotonic()

    async def current(self, js: JetStreamContext, within_s: float = 1.0, *, strict: bool = True) -> None:
        """Make sure nothing was forgotten that this copy does not know, at most ``within_s`` ago.

        A process that was stopped (SIGSTOP, a paused VM) while a forget ran resumes with its
        events in hand and the watch's news still unread in its socket: before publishing, one
        request tells whether the bucket holds tombstones it has not seen, and they are read.
        ``strict`` False: if the bucket does not answer (a cluster electing its leader), go on
        with what the watch has said, rather than hold everything up (the gateway's choice: its
        events and session records must not wait on this bucket's election; it was current a
        moment ago, and checks again within ``within_s``)."""
        if time.monotonic() - self._checked < within_s:
            return
        try:
            last = (await js.stream_info(f"KV_{self._bucket}")).state.last_seq
            if last > self._seen:
                await self.load(js)
        except Exception as exc:
            if strict:
                raise
            log.debug("tombstones: bucket %s did not answer (%r); going on with what the watch said", self._bucket, exc)
            return
        self._checked = time.monotonic()

    async def follow(self, js: JetStreamContext) -> None:
        """Load, then learn new tombstones as they are written, until cancelled (NATS trouble: retried)."""
        while True:
            try:
                await self.load(js)
                kv = await self.bucket(js)
                watcher = await kv.watchall(include_history=False, ignore_deletes=True)
                async for entry in watcher:
                    if entry is not None:
                        self.add(entry.key)
                        self._seen = max(self._seen, entry.revision or 0)
            except Exception as exc:  # timeouts, a server between leaders: learn again shortly
                log.warning("tombstones: bucket %s unavailable (%r); retrying", self._bucket, exc)
            await anyio.sleep(_RETRY_S)


async def write_tombstone(js: JetStreamContext, key: str, what: str, bucket: str = FORGOTTEN_BUCKET) -> None:
    """Write one tombstone (idempotent: a second write of the same key changes nothing that matters)."""
    from pipeline.streams import ensure_key_value

    kv = await ensure_key_value(js, bucket)
    await kv.put(key, orjson.dumps({"at": time.time(), "what": what}))
