"""Inference servers from a NATS KV bucket: a trainer writes addresses, every gateway follows.

A remote engine's pool (``--engine vllm-http|sglang-http``) can be changed at run time three
ways: ``--upstream`` at start, ``POST /admin/upstreams``, and this: with ``--upstreams-bucket B``
and ``--nats-url``, the gateway watches the KV bucket ``B``. Each key names one server and its
value is the server's URL::

    nats kv put B rollout-0 http://10.0.0.5:8000     # add (or move) a server
    nats kv del B rollout-0                          # take it out

A trainer that starts and stops its rollout servers (verl's ``LLMServerManager.get_addresses()``)
writes them here, and every gateway replica picks them up within a moment, without restarts. On
(re)connecting the gateway reads the bucket's current contents and removes the servers it had
added from the bucket that are gone from it; servers given by ``--upstream`` or the admin route are
never removed by the bucket. NATS down: the pool keeps what it has, and the watcher retries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
from pipeline.connection import NatsAuth, connect
from pipeline.errors import NatsRefused
from pipeline.kv import watch_entries

from stream_gateway._errors import InvalidRequest

if TYPE_CHECKING:
    from stream_gateway.engines import UpstreamControl

__all__ = ["UpstreamFollower"]

log = logging.getLogger(__name__)


class UpstreamFollower:
    """Keeps ``engine``'s pool in step with the KV bucket ``bucket``."""

    def __init__(
        self, engine: UpstreamControl, servers: tuple[str, ...], bucket: str, auth: NatsAuth | None = None
    ) -> None:
        self._engine = engine
        self._servers = servers
        self._auth = auth
        self._bucket = bucket
        self._by_key: dict[str, str] = {}  # bucket key -> the URL it added
        self.synced = anyio.Event()  # set once the bucket's contents were read (or NATS failed)

    async def run(self) -> None:
        """Follow the bucket until cancelled, reconnecting with backoff."""
        backoff = 0.5
        while True:
            try:
                await self._follow()
            except NatsRefused as exc:
                log.error("upstreams bucket %s: %s; retrying", self._bucket, exc)
            except Exception as exc:  # nats-py raises several unrelated types for connection trouble
                log.warning("upstreams bucket %s: NATS failed (%s); retrying", self._bucket, exc)
            self.synced.set()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _follow(self) -> None:
        nc = await connect(
            self._servers, self._auth, name="stream-gateway-upstreams", connect_timeout=2, allow_reconnect=False
        )
        try:
            js = nc.jetstream()
            kv = await js.create_key_value(bucket=self._bucket, history=1)
            current: dict[str, str] = {}
            initial = True
            # Not kv.watchall(): its end-of-contents None can come before the contents (pipeline/kv.py),
            # and a reconcile with half the bucket would take live servers out of the pool.
            async for entry in watch_entries(kv):
                if entry is None:  # the end of the bucket's current contents
                    if initial:
                        await self._reconcile(current)
                        initial = False
                    continue
                key = entry.key
                value = (entry.value or b"").decode("utf-8", "replace").strip()
                deleted = entry.operation in ("DEL", "PURGE") or not value
                if initial:
                    if deleted:
                        current.pop(key, None)
                    else:
                        current[key] = value
                    continue
                if deleted:
                    self._remove_key(key)
                else:
                    await self._put(key, value)
        finally:
            with anyio.CancelScope(shield=True):
                await nc.close()

    async def _reconcile(self, current: dict[str, str]) -> None:
        for key in [k for k in self._by_key if k not in current]:
            self._remove_key(key)
        for key, url in current.items():
            await self._put(key, url)
        self.synced.set()
        log.info("upstreams bucket %s: %d servers: %s", self._bucket, len(current), sorted(current.values()))

    async def _put(self, key: str, url: str) -> None:
        previous = self._by_key.get(key)
        if previous == url:
            return
        if previous is not None:
            self._remove_key(key)
        try:
            upstream, added = await self._engine.add_upstream(url)
        except InvalidRequest as exc:
            log.warning("upstreams bucket %s: key %s: %s", self._bucket, key, exc.message)
            return
        if added or upstream.url in self._by_key.values():
            self._by_key[key] = upstream.url  # a server the bucket did not add is not the bucket's to remove

    def _remove_key(self, key: str) -> None:
        url = self._by_key.pop(key, None)
        if url is not None and url not in self._by_key.values():
            self._engine.remove_upstream(url)
