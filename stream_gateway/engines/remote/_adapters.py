"""LoRA adapters on a pool of servers: which versions each holds, loads, unloads, and catching up.

:meth:`AdapterFleet.load` loads version N of adapter ``NAME`` on every healthy server as the
adapter ``NAME@vN`` (the dialect's load route; the directory must be readable by the servers at
that path), so no prefix cache computed under an older version is reused. Each server records
which versioned names it holds and how many requests are in flight on each
(:class:`~stream_gateway.engines._pool.Upstream`); a request on an adapter names its current
version and goes only to a server that holds it. A server whose load failed takes none of that
adapter's requests until a retry (every 30 s) succeeds; older versions are unloaded from a server
once none of this engine's requests uses them there; a server added later, or one that answers
that it lacks the version (a restart), is given the current adapters again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import anyio
import httpx

from stream_gateway._errors import EngineUnavailable
from stream_gateway.engines._base import WeightUpdateReport
from stream_gateway.engines.remote._wire import describe, error_message

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from stream_gateway.engines._pool import Upstream, UpstreamPool
    from stream_gateway.engines.remote._dialect import Dialect

__all__ = ["AdapterFleet", "adapter_model"]

log = logging.getLogger(__name__)

_RETRY_S = 30.0  # a server that failed to load an adapter version is asked again after this


def adapter_model(name: str, version: int) -> str:
    """The model name of version ``version`` of LoRA adapter ``name`` on the servers: ``NAME@vN``.

    A new version is a new name there, so no server reuses for it a prefix cache computed under
    an older one (huggingface/trl#7017 names its adapter versions the same way)."""
    return f"{name}@v{version}"


def _adapter_of(model: str) -> str:
    """The adapter name of a versioned model name (``NAME@vN`` -> ``NAME``)."""
    return model.rsplit("@v", 1)[0]


class AdapterFleet:
    """The LoRA adapters of one remote engine, across its pool (see the module docstring)."""

    def __init__(self, pool: UpstreamPool, dialect: Dialect) -> None:
        self._pool = pool
        self._dialect = dialect
        self._versions: dict[str, int] = {}  # name -> current version
        self.versions: Mapping[str, int] = MappingProxyType(self._versions)
        self._paths: dict[str, str] = {}  # name -> the directory its current version was loaded from
        self._locks: dict[Upstream, anyio.Lock] = {}  # one load/unload at a time per server
        self._pending: set[Upstream] = set()
        self._client: httpx.AsyncClient | None = None
        self._task_group: TaskGroup | None = None

    def attach(self, client: httpx.AsyncClient | None, task_group: TaskGroup | None) -> None:
        """The engine's control client and task group (``None``: stopped; nothing is scheduled)."""
        self._client, self._task_group = client, task_group

    # -- what requests ask ----------------------------------------------------------------------

    def model_for(self, adapter: str | None) -> tuple[str | None, int | None]:
        """The versioned model name a request on ``adapter`` names now, and that version."""
        if adapter is None:
            return None, None
        version = self._versions.get(adapter)
        if version is None:
            raise EngineUnavailable(f"The LoRA adapter {adapter} is not loaded on the inference servers.")
        return adapter_model(adapter, version), version

    def acquire(self, upstream: Upstream, model: str) -> None:
        """A request on ``model`` goes to ``upstream`` (an old version is unloaded only once idle)."""
        upstream.adapter_requests[model] = upstream.adapter_requests.get(model, 0) + 1

    def release(self, upstream: Upstream, model: str) -> None:
        """A request on ``model`` there is done; unload an old version once it is idle."""
        left = upstream.adapter_requests.get(model, 0) - 1
        if left > 0:
            upstream.adapter_requests[model] = left
            return
        upstream.adapter_requests.pop(model, None)
        if model in upstream.adapters and model not in self._current():
            self.schedule_sync(upstream)

    def lost(self, upstream: Upstream, model: str) -> None:
        """``upstream`` answered that it does not hold ``model`` (it restarted?): load it again."""
        upstream.adapters.discard(model)
        self.schedule_sync(upstream)

    # -- loading and unloading ------------------------------------------------------------------

    async def load(self, name: str, path: str, policy_version: int) -> WeightUpdateReport:
        """Load ``path`` as version ``policy_version`` of adapter ``name`` on every healthy server.

        Raises :class:`~stream_gateway.lora.AdapterRefused` when no server loaded it (the current
        version stays), :class:`EngineUnavailable` with no healthy server.
        """
        from stream_gateway._errors import AdapterRefused

        if self._client is None:
            raise EngineUnavailable("The engine is not running.")
        model = adapter_model(name, policy_version)
        targets = [u for u in self._pool if u.healthy]
        if not targets:
            raise EngineUnavailable(f"No healthy inference server to load the LoRA adapter {model} on.")
        started = time.perf_counter()
        outcomes: dict[str, tuple[int, str] | None] = {}  # url -> None (loaded) or (status, why)

        async def load(upstream: Upstream) -> None:
            outcomes[upstream.url] = await self._load_on(upstream, model, path)

        async with anyio.create_task_group() as tg:
            for upstream in targets:
                tg.start_soon(load, upstream)
        refused = {url: outcome for url, outcome in outcomes.items() if outcome is not None}
        if len(refused) == len(targets):
            for upstream in targets:
                upstream.adapter_failures.pop(model, None)  # never current: nothing to retry
            statuses = {status for status, _ in refused.values()}
            reasons = "; ".join(f"{url}: {why}" for url, (_, why) in refused.items())
            raise AdapterRefused(
                "unreadable" if statuses == {404} else "unsupported",
                f"no inference server loaded {model} from {path} ({reasons})",
            )
        previous = self._versions.get(name, 0)
        self._versions[name] = policy_version
        self._paths[name] = path
        loaded_s = time.perf_counter() - started
        on_adapter = 0
        for upstream in self._pool:
            for held in list(upstream.adapter_failures):  # older versions' failures no longer matter
                if held != model and _adapter_of(held) == name:
                    del upstream.adapter_failures[held]
            on_adapter += sum(n for held, n in upstream.adapter_requests.items() if _adapter_of(held) == name)
            if self.out_of_date(upstream):
                self.schedule_sync(upstream)  # unload the versions before, where idle
        log.info("adapter %s %d -> %d: loaded as %s on %d of %d servers in %.2f s%s",
                 name, previous, policy_version, model, len(targets) - len(refused), len(targets), loaded_s,
                 f" (refused by {', '.join(refused)})" if refused else "")  # fmt: skip
        return WeightUpdateReport(policy_version, previous, 0, loaded_s, 0.0, on_adapter)

    def unload(self, name: str) -> None:
        """Stop serving adapter ``name``: requests in flight on it finish, and each server unloads
        its versions once idle. KeyError for a name not loaded."""
        del self._versions[name]
        self._paths.pop(name, None)
        for upstream in self._pool:
            for model in list(upstream.adapter_failures):
                if _adapter_of(model) == name:
                    del upstream.adapter_failures[model]
            if self.out_of_date(upstream):
                self.schedule_sync(upstream)

    def out_of_date(self, upstream: Upstream) -> bool:
        """A current version missing there (not failed lately), or an older one idle there."""
        current, now = self._current(), time.monotonic()
        for model in current:
            failed = upstream.adapter_failures.get(model)
            if model not in upstream.adapters and (failed is None or now - failed[0] >= _RETRY_S):
                return True
        return any(model not in current and not upstream.adapter_requests.get(model) for model in upstream.adapters)

    def schedule_sync(self, upstream: Upstream) -> None:
        """Bring ``upstream``'s adapters up to date in the background (once at a time per server)."""
        if self._task_group is None or upstream in self._pending:
            return
        self._pending.add(upstream)
        self._task_group.start_soon(self.sync, upstream)

    async def sync(self, upstream: Upstream) -> None:
        """Load the current adapter versions a server lacks, and unload its idle old ones."""
        self._pending.discard(upstream)
        if upstream.removed or not upstream.healthy:
            return
        try:
            now = time.monotonic()
            for name, version in list(self._versions.items()):
                model, path = adapter_model(name, version), self._paths.get(name)
                failed = upstream.adapter_failures.get(model)
                if path is None or model in upstream.adapters or (failed and now - failed[0] < _RETRY_S):
                    continue
                if self._versions.get(name) == version:  # not replaced or unloaded meanwhile
                    await self._load_on(upstream, model, path)
            current = self._current()
            for model in sorted(upstream.adapters - current):
                if not upstream.adapter_requests.get(model):
                    await self._unload_on(upstream, model)
        except Exception:  # never let it take the health checks down with it
            log.exception("%s: bringing its LoRA adapters up to date failed", upstream.url)

    def _current(self) -> set[str]:
        return {adapter_model(name, version) for name, version in self._versions.items()}

    def _lock(self, upstream: Upstream) -> anyio.Lock:
        lock = self._locks.get(upstream)
        if lock is None:
            lock = self._locks[upstream] = anyio.Lock()
        return lock

    async def _load_on(self, upstream: Upstream, model: str, path: str) -> tuple[int, str] | None:
        """Load adapter ``model`` from ``path`` on one server: ``None`` once it holds it, else
        ``(HTTP status or 0, why)``, recorded as the server's failure."""
        assert self._client is not None
        async with self._lock(upstream):
            if model in upstream.adapters:
                return None
            route = self._dialect.load_adapter_path
            try:
                response = await self._client.post(upstream.url + route, json={"lora_name": model, "lora_path": path})
                status, message = response.status_code, error_message(response.content) or ""
            except httpx.HTTPError as exc:
                status, message = 0, describe(exc)
            # Loaded already (by another gateway of this pool, or before this one restarted): a
            # versioned name is one set of weights, so it is held. vLLM: "... has already been
            # loaded"; SGLang: "... because it is already loaded".
            if status == 200 or (status == 400 and "already" in message and model in message):
                upstream.adapters.add(model)
                upstream.adapter_failures.pop(model, None)
                log.info("%s holds LoRA adapter %s (%s)", upstream.url, model, path)
                return None
            why = f"{route} answered {status}: {message}" if status else message
            first = model not in upstream.adapter_failures
            upstream.adapter_failures[model] = (time.monotonic(), why)
            (log.warning if first else log.debug)("%s could not load LoRA adapter %s from %s: %s; no requests of "
                                                  "it go there", upstream.url, model, path, why)  # fmt: skip
            return status, why

    async def _unload_on(self, upstream: Upstream, model: str) -> None:
        """Unload an old adapter version from one server (kept, and asked again later, on failure)."""
        assert self._client is not None
        async with self._lock(upstream):
            if model not in upstream.adapters or upstream.adapter_requests.get(model):
                return
            route = self._dialect.unload_adapter_path
            try:
                response = await self._client.post(upstream.url + route, json={"lora_name": model})
                status, message = response.status_code, error_message(response.content) or ""
            except httpx.HTTPError as exc:
                log.warning("%s: unloading LoRA adapter %s failed (%s); asking again later",
                            upstream.url, model, describe(exc))  # fmt: skip
                return
            if status == 200 or status == 404 or (status == 400 and model in message):  # gone already
                upstream.adapters.discard(model)
                log.info("%s unloaded LoRA adapter %s", upstream.url, model)
            else:
                log.warning("%s: unloading LoRA adapter %s answered %d (%s); asking again later",
                            upstream.url, model, status, message)  # fmt: skip
