"""A pool of inference servers: least-outstanding routing, session affinity, health checks.

:class:`UpstreamPool` knows the servers behind a remote engine (``--upstream URL``, repeated,
``POST /admin/upstreams`` or a NATS KV bucket a trainer writes addresses into) and picks one per
request:

* **Affinity first.** A request with an affinity key (the gateway passes the session id) goes to
  the server that served that key last, as long as that server is healthy and not saturated
  (``STICKY_SLACK`` or more requests in flight beyond the least busy server's): its prefix cache
  holds the conversation, which is worth a queue. Affinities are kept for the ``affinity_size``
  most recently used keys. The same key rides upstream as ``X-Session-ID``
  (:func:`~.remote._stream_http.session_hints`) for the servers' KV events and any router between.
* **A key's first request goes to its home**: the healthy server that ranks highest for the key
  by rendezvous hashing (blake2b of key and URL), unless that server has ``HOME_SLACK`` or more
  requests in flight beyond the least busy one's. Every process computes the same home, so with
  ``--workers N`` (or several gateway replicas) a session lands on the same server whichever
  process takes its request, and a server added or removed moves only the keys whose home it is
  or becomes.
* **Otherwise least outstanding.** The healthy server with the fewest requests in flight (ties:
  the one added first), which spreads load without knowing anything about the servers.

Each server counts how its requests were picked (``picks``: ``sticky``, ``home``, ``moved`` for a
key sent elsewhere than its home because the home was busy (an unhealthy server is nobody's home:
the next in rank is), ``least`` without a key),
shown by ``GET /admin/upstreams``.

LoRA adapters (``docs/engines.md``): each server records the versioned adapter names it holds
(``NAME@vN``, loaded by :meth:`~.remote.RemoteEngine.load_adapter`) and how many requests are in
flight on each; :meth:`UpstreamPool.pick` with ``adapter=`` only considers servers holding it.

A server is unhealthy after a failed health check (``GET /health`` answering anything but 200,
or not answering within ``health_timeout_s``) or a connection failure while serving a request,
and healthy again after the next successful check. Checks run every ``health_interval_s`` for
every server, healthy or not, so a restarted server comes back on its own.

The pool does no I/O of its own: the engine that owns it runs :meth:`UpstreamPool.check` with its
HTTP client (see :mod:`.remote`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from stream_gateway._errors import EngineUnavailable, InvalidRequest

__all__ = ["Upstream", "UpstreamPool", "normalize_url"]

log = logging.getLogger(__name__)

HOME_SLACK = 4
"""A key's home takes its first request unless it has this many more in flight than the least busy server."""
STICKY_SLACK = 16
"""A key stays on its server unless that server has this many more in flight than the least busy one."""


def normalize_url(url: str) -> str:
    """``http(s)://host:port[/prefix]`` without a trailing slash; refuses anything else."""
    text = url.strip().rstrip("/")
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise InvalidRequest(f"`{url}` is not an http(s) server address (http://host:port)", param="upstreams")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        raise InvalidRequest(f"`{url}` has an invalid port", param="upstreams") from exc
    return text


@dataclass(slots=True, eq=False)
class Upstream:
    """One server and what the pool knows about it."""

    url: str
    added_at: float = field(default_factory=time.time)
    outstanding: int = 0  # requests in flight now
    healthy: bool = False  # until the first check passes
    checked: bool = False  # a check has completed (either way)
    failures: int = 0  # consecutive failed checks or requests
    last_error: str | None = None
    served: int = 0  # requests routed here since it was added
    model: str | None = None  # the model name the server serves (learned from it)
    max_model_len: int | None = None
    removed: bool = False
    adapters: set[str] = field(default_factory=set)  # versioned LoRA adapter names loaded there (NAME@vN)
    adapter_requests: dict[str, int] = field(default_factory=dict)  # versioned name -> requests in flight
    # versioned name -> (when, why) its load failed there: not retried before a while (see .remote)
    adapter_failures: dict[str, tuple[float, str]] = field(default_factory=dict)
    picks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("sticky", "home", "moved", "least"), 0))
    streamed_at: float = 0.0  # time.monotonic() of the last step a stream read from it
    slow_checks: int = 0  # checks it did not answer in time while its streams flowed (kept in rotation)
    reloading: bool = False  # this gateway is loading weights into it (paused, busy: checks forgiven)

    def describe(self) -> dict[str, Any]:
        """The JSON view of ``GET /admin/upstreams``."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "adapters": sorted(self.adapters),
            "adapter_requests": dict(sorted(self.adapter_requests.items())),
            "adapter_failures": {name: why for name, (_, why) in sorted(self.adapter_failures.items())},
            "picks": dict(self.picks),
            "slow_checks": self.slow_checks,
        }


class UpstreamPool:
    """The servers of one remote engine, and which one takes the next request."""

    def __init__(self, urls: list[str] | tuple[str, ...] = (), *, affinity_size: int = 100_000) -> None:
        self._upstreams: dict[str, Upstream] = {}
        self._affinity: OrderedDict[str, Upstream] = OrderedDict()
        self._affinity_size = affinity_size
        for url in urls:
            self.add(url)

    def __iter__(self) -> Iterator[Upstream]:
        return iter(list(self._upstreams.values()))

    def __len__(self) -> int:
        return len(self._upstreams)

    def get(self, url: str) -> Upstream | None:
        """The upstream at ``url`` (normalized), if the pool has it."""
        return self._upstreams.get(normalize_url(url))

    def add(self, url: str) -> tuple[Upstream, bool]:
        """Add a server (unhealthy until its first check); ``(upstream, False)`` if it was there."""
        url = normalize_url(url)
        existing = self._upstreams.get(url)
        if existing is not None:
            return existing, False
        upstream = Upstream(url)
        self._upstreams[url] = upstream
        log.info("upstream %s added (%d in the pool)", url, len(self._upstreams))
        return upstream, True

    def remove(self, url: str) -> Upstream | None:
        """Take a server out: no new requests go to it; those in flight finish there."""
        upstream = self._upstreams.pop(normalize_url(url), None)
        if upstream is not None:
            upstream.removed = True
            upstream.healthy = False
            log.info(
                "upstream %s removed (%d requests still in flight there, %d servers left)",
                upstream.url, upstream.outstanding, len(self._upstreams),
            )  # fmt: skip
        return upstream

    def pick(
        self, affinity: str | None = None, exclude: frozenset[Upstream] = frozenset(), *, adapter: str | None = None
    ) -> Upstream:
        """The server for the next request; raises :class:`EngineUnavailable` if none is healthy
        (or, with ``adapter``, a versioned adapter name, if no healthy one holds it)."""
        if affinity is not None:
            sticky = self._affinity.get(affinity)
            if (
                sticky is not None
                and sticky.healthy
                and not sticky.removed
                and sticky not in exclude
                and (adapter is None or adapter in sticky.adapters)
                and not self._saturated(sticky, exclude, adapter)
            ):
                self._affinity.move_to_end(affinity)
                sticky.picks["sticky"] += 1
                return sticky
        best: Upstream | None = None
        home: Upstream | None = None
        home_rank = b""
        for upstream in self._upstreams.values():
            if not upstream.healthy or upstream in exclude:
                continue
            if adapter is not None and adapter not in upstream.adapters:
                continue
            if best is None or upstream.outstanding < best.outstanding:
                best = upstream
            if affinity is not None:
                rank = _rank(affinity, upstream.url)
                if rank > home_rank:
                    home, home_rank = upstream, rank
        if best is None:
            raise EngineUnavailable(self._unavailable_message(adapter))
        if affinity is None:
            best.picks["least"] += 1
            return best
        if home is not None and home.outstanding < best.outstanding + HOME_SLACK:
            best = home
            best.picks["home"] += 1
        else:
            best.picks["moved"] += 1
        self._affinity[affinity] = best
        self._affinity.move_to_end(affinity)
        while len(self._affinity) > self._affinity_size:
            self._affinity.popitem(last=False)
        return best

    def _saturated(self, upstream: Upstream, exclude: frozenset[Upstream], adapter: str | None) -> bool:
        """``upstream`` has ``STICKY_SLACK`` or more in flight beyond the least busy eligible server."""
        if upstream.outstanding < STICKY_SLACK:
            return False  # cheap answer first: nobody has fewer than 0
        least = min(
            (
                u.outstanding
                for u in self._upstreams.values()
                if u.healthy and u not in exclude and (adapter is None or adapter in u.adapters)
            ),
            default=upstream.outstanding,
        )
        return upstream.outstanding >= least + STICKY_SLACK

    def _unavailable_message(self, adapter: str | None = None) -> str:
        if not self._upstreams:
            return "No inference server is configured (add one with --upstream or POST /admin/upstreams)."
        if adapter is not None and any(u.healthy for u in self._upstreams.values()):
            states = "; ".join(
                f"{u.url}: " + (u.adapter_failures[adapter][1] if adapter in u.adapter_failures else "not loaded yet")
                for u in self._upstreams.values()
                if u.healthy
            )
            return f"No healthy inference server holds the LoRA adapter {adapter} ({states})."
        states = "; ".join(f"{u.url}: {u.last_error or 'not checked yet'}" for u in self._upstreams.values())
        return f"No healthy inference server ({states})."

    def mark_failed(self, upstream: Upstream, error: str) -> None:
        """A check or a request failed: no new requests go there until a check passes."""
        upstream.failures += 1
        upstream.last_error = error
        upstream.checked = True
        if upstream.healthy:
            log.warning("upstream %s is unhealthy: %s", upstream.url, error)
        upstream.healthy = False

    def mark_healthy(self, upstream: Upstream) -> None:
        """A check passed."""
        if not upstream.healthy and not upstream.removed:
            log.info("upstream %s is healthy", upstream.url)
            upstream.healthy = True
        upstream.failures = 0
        upstream.last_error = None
        upstream.checked = True

    def describe(self) -> list[dict[str, Any]]:
        """Every server's state."""
        return [u.describe() for u in self._upstreams.values()]


def _rank(key: str, url: str) -> bytes:
    """``url``'s rendezvous rank for ``key``: the same in every process (unlike ``hash()``)."""
    return hashlib.blake2b(f"{key}\n{url}".encode(), digest_size=8).digest()
