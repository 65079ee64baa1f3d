"""The remote engine: the gateway renders and records, a pool of vLLM or SGLang servers samples.

``vllm-http`` and ``sglang-http`` keep everything the gateway does (chat template, token-exact
context, tool-call parsing, sessions, capture) on the gateway and send only token ids to the
servers, which answer with token ids and their logprobs. Nothing is re-tokenized on either side.
What a server's API spells its own way is its dialect's (:mod:`._vllm`, :mod:`._sglang`, behind
:class:`~._dialect.Dialect`); this module owns what they share: lifecycle, the pool and its
health checks, failover, the adapter fleet (:mod:`._adapters`) and the streaming client
(:mod:`._stream_http`).

Which logprobs are recorded is the server's choice: vLLM returns ``--logprobs-mode``'s values,
``raw_logprobs`` (the model's distribution before temperature and top-k/top-p) by default; start
it with ``--logprobs-mode processed_logprobs`` to record, as the in-process engines do, the
distribution the tokens were drawn from. See ``docs/engines.md``.

Requests go to :class:`~stream_gateway.engines._pool.UpstreamPool`'s pick (session affinity,
then least outstanding). A server that cannot be reached or answers 5xx before the first token is
marked unhealthy and the request tries the next healthy one; a server that fails after tokens
were streamed ends that stream with an :class:`~stream_gateway._errors.EngineError` (the client
gets an error frame, the turn is recorded as aborted), since a half-sent answer cannot be
replayed elsewhere. Closing the generator before the request finished closes the connection, so
the server sees the disconnect and aborts the request (vLLM and SGLang both do); once the
request finished, the connection is kept for the next one while the server writes the rest of
its answer (vLLM writes ``data: [DONE]`` as its own chunk after the finishing frame).

Policy versions: by default these servers are updated by whoever trains (verl's rollout
servers, an RL framework's weight sync), not by the gateway (``upstream_weights="announce"``).
The gateway labels tokens with the version the server reports when it does (vLLM's numeric
``weight_versions`` spans: its generate API's in 0.32, ``/v1/completions``' from 0.33, a
stream-gateway's; SGLang's numeric ``meta_info.weight_version``), and otherwise with the version
announced for the pool (``policy.updated`` on NATS, or ``POST /policy/weights``). With
``upstream_weights="reload"`` the gateway loads each version into every vLLM server itself
(:meth:`RemoteEngine.load_weights`, :meth:`~._vllm.VllmDialect.reload_weights`) and labels it.

Routed experts (Rollout Routing Replay, ``docs/moe.md``): built with ``routed_experts=True`` and a
model whose config (``--model``, read for the tokenizer anyway) declares experts, the engine asks
every server for the experts that routed each position (``return_routed_experts: true`` and the
dialect's start field), the dialect decodes them, and :class:`~._routes.RouteCheck` checks and
places them on the request's last step. A server that refuses the flag (a 400 naming
``return_routed_experts``) is asked again without it, and no more for the life of this engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway._errors import (
    EngineError,
    EngineUnavailable,
    HttpFailure,
    InvalidRequest,
    UpstreamFailed,
    WeightsRejected,
)
from stream_gateway.engines._base import (
    EngineStatistics,
    EngineStep,
    ExpertShape,
    SamplingParams,
    StepSink,
    WeightUpdateReport,
)
from stream_gateway.engines._pool import Upstream, UpstreamPool
from stream_gateway.engines.remote._adapters import AdapterFleet
from stream_gateway.engines.remote._dialect import Dialect, Exchange
from stream_gateway.engines.remote._grammar import GrammarCheck, end_ids
from stream_gateway.engines.remote._interval import StreamIntervals
from stream_gateway.engines.remote._reading import Pump, Reading, StepQueue, TokenCount
from stream_gateway.engines.remote._routes import RouteCheck, Wanted, expert_config
from stream_gateway.engines.remote._sglang import SglangDialect
from stream_gateway.engines.remote._stream_http import StreamClient, StreamResponse, control_transport, session_hints
from stream_gateway.engines.remote._vllm import VllmDialect
from stream_gateway.engines.remote._vllm_generate import VllmGenerateDialect
from stream_gateway.engines.remote._wire import SseFrames, describe, error_message, error_param

if TYPE_CHECKING:
    import torch
    from anyio.abc import TaskGroup

__all__ = ["DIALECTS", "PROTOCOLS", "UPSTREAM_WEIGHTS", "RemoteEngine"]

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 30.0  # a slow health check is forgiven a server that streamed a step this recently

DIALECTS: dict[str, type[Dialect]] = {
    "vllm": VllmDialect,
    "vllm-generate": VllmGenerateDialect,
    "sglang": SglangDialect,
}
"""The wire dialects by name (``RemoteEngine(protocol=...)``)."""
PROTOCOLS: dict[str, str] = {"vllm-http": "vllm", "sglang-http": "sglang"}
"""Engine name (``--engine``) -> its default dialect (``--vllm-api generate``: ``vllm-generate``)."""
UPSTREAM_WEIGHTS = ("announce", "reload")
"""Who loads new weights into the servers: whoever trains (``announce``: the gateway records the
version) or the gateway itself (``reload``: :meth:`RemoteEngine.load_weights`)."""


class _Retry(Exception):
    """The server failed before sending anything: the request may go to another one."""


class _AdapterMissing(_Retry):
    """The server does not hold the LoRA adapter version the request named (it restarted, say)."""


class RemoteEngine:
    """Samples on a pool of vLLM (``vllm-http``) or SGLang (``sglang-http``) servers over HTTP."""

    remote = True
    constrained_decoding = False  # the dialect's (VllmDialect: structured outputs), set per engine
    vision: VisionProcessor | None = None  # text only (docs/images.md)

    @property
    def upstreams(self) -> RemoteEngine:
        """This engine is its own pool control (:class:`~stream_gateway.engines.UpstreamControl`)."""
        return self

    @property
    def experts(self) -> ExpertShape | None:
        """The routes' shape: the config's until servers send routes, then theirs."""
        return self._route_check.experts

    @property
    def adapters(self) -> Mapping[str, int]:
        """The LoRA adapters served: name -> current version."""
        return self._fleet.versions

    def __init__(
        self,
        tokenizer: str | Path,
        *,
        protocol: str,
        upstreams: Sequence[str] = (),
        served_model_name: str,
        max_model_len: int | None = None,
        api_key: str | None = None,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
        max_connections: int = 512,
        routed_experts: bool = False,
        upstream_weights: str = "announce",
        stream_interval: int = 1,
        stream_interval_max: int = 1,
    ) -> None:
        self.dialect: Dialect = DIALECTS[protocol]()
        if upstream_weights not in UPSTREAM_WEIGHTS:
            raise ValueError(f"upstream_weights must be one of {UPSTREAM_WEIGHTS}, not {upstream_weights!r}")
        if upstream_weights == "reload" and not self.dialect.drives_weights:
            raise ValueError(f"the {self.dialect.engine} engine cannot load weights into its servers")
        self.reloads_weights = upstream_weights == "reload"
        self._reloaded: tuple[str, int] | None = None  # the checkpoint and version every server must serve
        self._weights_lock = anyio.Lock()
        self.name = self.dialect.engine
        self.constrained_decoding = self.dialect.constrained
        self.model_id = served_model_name
        self.policy_version = 0
        self.pool = UpstreamPool(list(upstreams))
        self.tokenizer: PreTrainedTokenizerBase
        self._tokenizer_path = str(tokenizer)
        self._max_model_len = max_model_len
        self._fallback_len = 4096
        self.max_model_len = max_model_len or self._fallback_len
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._health_interval = health_interval_s
        self._health_timeout = health_timeout_s
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=connect_timeout_s
        )
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None  # health checks, model info, adapters
        self._streams: StreamClient | None = None  # the generation requests (the per-token path)
        self._task_group: TaskGroup | None = None
        self._active = 0
        self._total_requests = 0
        self._tokens = TokenCount()  # tokens streamed, all requests
        self._routed_experts = routed_experts
        self._route_check = RouteCheck(None)
        self._fleet = AdapterFleet(self.pool, self.dialect)
        self._end_ids: frozenset[int] = frozenset()  # what a server ends a turn with (._grammar.end_ids)
        self.intervals = StreamIntervals(stream_interval, stream_interval_max)  # tokens a frame (._interval)

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> RemoteEngine:
        self.tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, self._tokenizer_path)
        self._end_ids = await anyio.to_thread.run_sync(end_ids, self.tokenizer, self._tokenizer_path)
        model_max = getattr(self.tokenizer, "model_max_length", 0) or 0
        self._fallback_len = int(model_max) if 0 < model_max < 10_000_000 else 4096
        self._update_max_model_len()
        if self._routed_experts:
            config = await anyio.to_thread.run_sync(expert_config, self._tokenizer_path)
            self._route_check = RouteCheck(config)
            if config is None:
                log.info("%s: %s declares no experts: no routes asked for", self.name, self._tokenizer_path)
        transport = control_transport(self._max_connections)
        self._client = httpx.AsyncClient(timeout=self._timeout, transport=transport, headers=self._headers)
        timeout = self._timeout
        assert timeout.connect is not None and timeout.read is not None and timeout.pool is not None
        self._streams = StreamClient(
            connect_timeout=timeout.connect,
            read_timeout=timeout.read,
            pool_timeout=timeout.pool,
            max_connections=self._max_connections,
            max_idle=self._max_connections,  # idle ones are cheap; every stream's next turn reuses one
            headers=self._headers,
        )
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._fleet.attach(self._client, self._task_group)
        await self.check_all()  # the first requests find the healthy servers already known
        self._task_group.start_soon(self._health_loop)
        self.intervals.start(self._task_group)
        healthy = sum(u.healthy for u in self.pool)
        log.info("%s: %d of %d servers healthy: %s", self.name, healthy, len(self.pool), [u.url for u in self.pool])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._task_group is not None:
                self._task_group.cancel_scope.cancel()
                await self._task_group.__aexit__(None, None, None)
        finally:
            self._task_group = None
            self._fleet.attach(None, None)
            if self._streams is not None:
                await self._streams.aclose()
                self._streams = None
            if self._client is not None:
                await self._client.aclose()
                self._client = None

    def _update_max_model_len(self) -> None:
        """``--max-model-len`` if given, else the smallest any server reported, else the tokenizer's."""
        if self._max_model_len is not None:
            self.max_model_len = self._max_model_len
            return
        reported = [u.max_model_len for u in self.pool if u.max_model_len]
        self.max_model_len = min(reported) if reported else self._fallback_len

    # -- the pool -----------------------------------------------------------------------------

    def upstream_list(self) -> list[Upstream]:
        """The servers of the pool, in order."""
        return list(self.pool)

    def describe_upstreams(self) -> list[dict[str, Any]]:
        """The pool as ``GET /admin/upstreams`` shows it."""
        return self.pool.describe()

    async def add_upstream(self, url: str) -> tuple[Upstream, bool]:
        """Add a server and check it at once (it takes requests as soon as the check passes).

        Returns the server and whether it is new (``False``: it was in the pool already).
        """
        upstream, added = self.pool.add(url)
        if added and self._client is not None:
            await self.check(upstream)
            if upstream.healthy and self._fleet.versions:
                await self._fleet.sync(upstream)  # the current adapters, before the reply
        return upstream, added

    def remove_upstream(self, url: str) -> Upstream | None:
        """Stop sending requests to a server; those in flight there finish."""
        upstream = self.pool.remove(url)
        self._update_max_model_len()
        return upstream

    async def check_all(self) -> None:
        """Check every server once, concurrently."""
        async with anyio.create_task_group() as tg:
            for upstream in self.pool:
                tg.start_soon(self.check, upstream)

    async def check(self, upstream: Upstream) -> None:
        """One health check: ``GET /health`` must answer 200; learn the served model once.

        No verdict while weights load into the pool: no check then, nor a timeout it caused (the
        update marks whoever failed). Seen on a real vLLM under load: a check timed out behind the
        reload, took out the pool's only server, and the requests after the update were refused."""
        assert self._client is not None
        if self._loading():
            return
        try:
            with anyio.fail_after(self._health_timeout):
                response = await self._client.get(f"{upstream.url}/health")
                if response.status_code != 200:
                    raise UpstreamFailed(f"/health answered {response.status_code}")
                if upstream.model is None:
                    await self._learn_model(upstream)
                    self._update_max_model_len()
            if self.reloads_weights and not await self._catch_up(upstream):
                return
        except TimeoutError as exc:
            if self._loading():
                return
            if _forgive_slow_check(upstream, self._health_timeout):
                self.pool.mark_healthy(upstream)
            else:
                self.pool.mark_failed(upstream, describe(exc))
            return
        except (httpx.HTTPError, UpstreamFailed, ValueError, KeyError, TypeError) as exc:
            self.pool.mark_failed(upstream, describe(exc))
            return
        except Exception as exc:  # a check must never end the checks (and the engine with them)
            # Seen in CI: a connection to a server that had just been restarted, reset between connect and
            # httpcore's first look at it, raised AttributeError from anyio's socket attributes (the
            # transport had already dropped its socket; anyio 4.16, httpcore 1.0.9). A server answering
            # /v1/models with a JSON list did the same from our own parsing.
            log.warning("health check of %s failed unexpectedly", upstream.url, exc_info=True)
            self.pool.mark_failed(upstream, describe(exc))
            return
        self.pool.mark_healthy(upstream)

    async def _catch_up(self, upstream: Upstream) -> bool:
        """With ``upstream_weights="reload"``: a server that does not serve the pool's weights (it
        restarted, or missed the update) loads them before it takes requests again; before the
        first reload, the weights the servers started with are labelled the pool's version (0, or
        the version announced), so every token they sample carries the gateway's version.
        ``False``: it could not (marked failed, unless an update under way delayed its answer)."""
        client = self._client
        assert client is not None

        async def served() -> str | None:
            with anyio.fail_after(self._health_timeout):
                return await self.dialect.served_version(client, upstream.url)

        version = self.policy_version if self._reloaded is None else self._reloaded[1]
        try:
            if await served() == str(version):
                return True
            async with self._weights_lock:  # an update under way finishes first
                if self._reloaded is None:  # nothing loaded yet: the weights it started with
                    if await served() != str(self.policy_version):
                        await self.dialect.label_weights(client, upstream.url, self.policy_version)
                    return True
                path, version = self._reloaded
                if await served() == str(version):
                    return True
                log.info("%s does not serve weights %d: loading %s into it", upstream.url, version, path)
                await self.dialect.reload_weights(client, upstream.url, path, version)
        except (httpx.HTTPError, UpstreamFailed, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and self._loading():
                return False  # an update under way delayed the answer: no verdict (see check)
            self.pool.mark_failed(upstream, f"weights {version} not loaded: {describe(exc)}")
            return False
        return True

    def _loading(self) -> bool:
        """Weights are being loaded into the pool: an update, or a server catching up."""
        return self._weights_lock.locked()

    async def _learn_model(self, upstream: Upstream) -> None:
        assert self._client is not None
        response = await self._client.get(f"{upstream.url}/v1/models")
        if response.status_code == 200:
            models = orjson.loads(response.content).get("data") or []
            if models:
                upstream.model = str(models[0]["id"])
                length = models[0].get("max_model_len")
                upstream.max_model_len = int(length) if length else None
                return
        path = await self.dialect.model_path(self._client, upstream.url)
        if path is None:
            raise UpstreamFailed(f"/v1/models answered {response.status_code}")
        upstream.model = path

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(self._health_interval)
            await self.check_all()
            for upstream in self.pool:
                if upstream.healthy and self._fleet.out_of_date(upstream):
                    self._fleet.schedule_sync(upstream)

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
    ) -> AsyncGenerator[EngineStep, None]:
        """Stream one request from a healthy server (failing over until the first token arrives):
        :meth:`push` into a queue (:class:`~._reading.StepQueue`, run in a task of its own) that
        this generator empties. Closing it early cancels that task, which aborts the request."""
        if images:  # the preparer refuses them first (vision is None): never sample without them
            raise EngineError(f"the {self.name} engine does not take images")
        queue = StepQueue()
        pushing = asyncio.get_running_loop().create_task(
            self.push(request_id, prompt_ids, params, queue, affinity=affinity)
        )
        pushing.add_done_callback(queue.close)
        try:
            while (steps := await queue.get()) is not None:
                for step in steps:
                    yield step
            pushing.result()  # what push raised
        finally:
            # The push is this generator's own task: cancelled and awaited here, however it ends.
            # (``asyncio.wait``, not ``await``: a cancellation of the consumer's task while it
            # waits must go on to it, not be taken for the push's.)
            if not pushing.done():
                pushing.cancel()
                await asyncio.wait({pushing})
            elif not pushing.cancelled():
                pushing.exception()  # retrieved: a consumer that left early does not want it

    async def push(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: StepSink,
        *,
        affinity: str | None = None,
    ) -> None:
        """Stream one request from a healthy server (failing over until the first token arrives)
        into ``sink``, from the connection's callbacks (:class:`~._reading.Pump`): this task waits
        once, for the answer's end. What ``sink`` raised is raised."""
        grammar = await _begin(self, params)
        hints = session_hints(affinity, request_id)
        tried: set[Upstream] = set()
        try:
            while True:
                with _attempt(self, affinity, tried, params.adapter) as (upstream, model, version):
                    reading: Reading | None = None
                    try:
                        response, exchange = await self._open(upstream, request_id, prompt_ids, params, model,
                                                              version, hints)  # fmt: skip
                        reading = _reading(self, upstream, response, exchange, grammar)
                        pump = Pump(reading, sink, response)
                        try:
                            pump.start()
                            await pump.done
                        finally:
                            pump.close()
                            await response.aclose(finish=reading.finished)
                        if pump.sink_failed:
                            break  # raised below, past the failover
                        if pump.error is not None:
                            raise pump.error
                        if not pump.stopped:
                            _read_out(self, upstream, reading)
                        return
                    except (_Retry, httpx.HTTPError, HttpFailure, UpstreamFailed) as exc:
                        streamed = reading is not None and reading.first_at > 0.0
                        _failed(self, upstream, model, request_id, exc, streamed=streamed)  # raises or tries on
            assert pump.error is not None
            raise pump.error
        finally:
            self._active -= 1

    async def _open(
        self,
        upstream: Upstream,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        model: str | None,
        version: int | None,
        hints: bytes,
    ) -> tuple[StreamResponse, Exchange]:
        """Send the request; its answer once it is known to stream (status 200), and what its reader needs."""
        wanted = self._route_check.wanted(upstream.url, len(prompt_ids), params.routes_from)
        path = self.dialect.generate_path
        response = await self._send(upstream, request_id, prompt_ids, params, wanted, model, hints)
        try:
            if response.status_code == 400 and wanted is not None:
                await response.aread()
                if error_param(response.content) == "return_routed_experts":
                    self._route_check.routeless.add(upstream.url)
                    log.warning("%s refuses return_routed_experts (%s): asking it for no routes from now on",
                                upstream.url, error_message(response.content))  # fmt: skip
                    await response.aclose()
                    wanted = None
                    response = await self._send(upstream, request_id, prompt_ids, params, None, model, hints)
            if response.status_code != 200:
                await response.aread()
                message = error_message(response.content) or f"HTTP {response.status_code}"
                if model is not None and response.status_code in (400, 404) and model in message:
                    # vLLM: 404 "The model `NAME@vN` does not exist."; SGLang: 400 "... not loaded: NAME@vN"
                    raise _AdapterMissing(f"{upstream.url}{path} answered {response.status_code}: {message}")
                if response.status_code >= 500 or response.status_code in (404, 408, 429):
                    raise _Retry(f"{upstream.url}{path} answered {response.status_code}: {message}")
                raise InvalidRequest(f"The inference server refused the request: {message}")
        except BaseException:
            await response.aclose()
            raise
        exchange = Exchange(upstream.url, params.top_logprobs, wanted, self._route_check, version,
                            lambda: self.policy_version)  # fmt: skip
        return response, exchange

    async def _send(
        self,
        upstream: Upstream,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        wanted: Wanted | None,
        model: str | None = None,
        hints: bytes = b"",
    ) -> StreamResponse:
        assert self._streams is not None
        dialect = self.dialect
        served = upstream.model or self.model_id
        body = dialect.body(request_id, prompt_ids, params, model=served, adapter=model)
        if (interval := self.intervals.next()) > 1:
            dialect.ask_interval(body, interval)
        if wanted is not None:
            dialect.want_routes(body, wanted.start)
        return await self._streams.post(
            upstream.url + dialect.generate_path, orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers=hints
        )  # the prompt ids: sessions.wire_ids

    # -- LoRA adapters --------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str, policy_version: int) -> WeightUpdateReport:
        """Load the PEFT adapter directory ``path`` as version ``policy_version`` of LoRA adapter
        ``name`` on every healthy server (:meth:`~._adapters.AdapterFleet.load`)."""
        return await self._fleet.load(name, path, policy_version)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name`` (KeyError for a name not loaded)."""
        self._fleet.unload(name)

    # -- weights and statistics ---------------------------------------------------------------

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """The servers read checkpoints from their disks, not tensors from the gateway's memory:
        announced only (with ``upstream_weights="reload"``, refused: nothing would load them)."""
        if self.reloads_weights:
            raise WeightsRejected(
                "unsupported", "the servers load checkpoints from a directory they can read: POST /policy/weights"
            )
        return self._announce(policy_version, len(tensors))

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """Record ``policy_version`` as the version the servers now serve; with
        ``upstream_weights="reload"``, first load ``path`` into every healthy server.

        Announced (the default): whoever trains updates the servers (verl's rollout servers,
        SGLang's ``/update_weights_from_disk``) and then announces the version to the gateway;
        ``path`` is not read.

        Reloaded: every server of the pool loads the checkpoint directory ``path`` (a path the
        servers can read) at once, keeping its requests in flight
        (:meth:`~._dialect.Dialect.reload_weights`); a server that cannot takes no requests until a
        health check finds it up and loads the weights into it, and if none could the version is
        refused (:class:`WeightsRejected` ``unreadable``), the pool's version unchanged. Servers
        that label their tokens (``--vllm-api generate``) make the recorded split exact; otherwise
        the tokens in flight across the update keep the old label.
        """
        if not self.reloads_weights:
            return self._announce(policy_version, 0)
        client = self._client
        if client is None:
            raise EngineUnavailable("The engine is not running.")
        started = time.perf_counter()
        # Every server, not only those passing their checks: a server that is slow to answer one
        # under load still samples, and needs the weights as much as the others.
        servers = list(self.pool)
        failures: dict[str, str] = {}

        in_flight = self._active
        async with self._weights_lock, anyio.create_task_group() as group:
            for upstream in servers:
                group.start_soon(_reload_one, self.dialect, self.pool, client, upstream, path, policy_version, failures)
        if failures:
            log.warning("%s: weights %d from %s not loaded by %s", self.name, policy_version, path, failures)
        if len(failures) == len(servers):
            raise WeightsRejected("unreadable", f"no server loaded {path}: {failures or 'the pool is empty'}")
        took = time.perf_counter() - started
        self._reloaded = (path, policy_version)
        previous, self.policy_version = self.policy_version, policy_version
        loaded = len(servers) - len(failures)
        log.info("%s: %d of %d servers reloaded %s as version %d in %.2f s (%d requests in flight kept)",
                 self.name, loaded, len(servers), path, policy_version, took, in_flight)  # fmt: skip
        return WeightUpdateReport(policy_version, previous, 0, took, took, in_flight)

    def _announce(self, policy_version: int, tensors: int) -> WeightUpdateReport:
        started = time.perf_counter()
        previous, self.policy_version = self.policy_version, policy_version
        pause = time.perf_counter() - started
        return WeightUpdateReport(policy_version, previous, tensors, pause, pause, self._active)

    def statistics(self) -> EngineStatistics:
        """A snapshot of the requests in flight; ``running`` while any server is healthy."""
        running = self._client is not None and any(u.healthy for u in self.pool)
        return EngineStatistics(self._active, 0, self._total_requests, self._tokens.n, running)


def _reading(
    engine: RemoteEngine, upstream: Upstream, response: StreamResponse, exchange: Exchange, grammar: GrammarCheck | None
) -> Reading:
    return Reading(upstream, SseFrames(response.where), engine.dialect.reader(exchange), grammar, engine._tokens)


async def _begin(engine: RemoteEngine, params: SamplingParams) -> GrammarCheck | None:
    """A request starts: the engine is running, it is counted, and its grammar (if any) is ready."""
    if engine._client is None:
        raise EngineUnavailable("The engine is not running.")
    grammar: GrammarCheck | None = None
    if params.constraint is not None:  # what the server samples is checked against it (._grammar)
        ends = engine._end_ids | params.stop_token_ids
        grammar = await anyio.to_thread.run_sync(GrammarCheck, params.constraint, engine.tokenizer, ends)
    engine._active += 1
    engine._total_requests += 1
    return grammar


@contextmanager
def _attempt(
    engine: RemoteEngine, affinity: str | None, tried: set[Upstream], adapter: str | None
) -> Iterator[tuple[Upstream, str | None, int | None]]:
    """One try of a request: the server picked (not one ``tried`` already) and counted busy while it runs."""
    fleet = engine._fleet
    # A LoRA adapter's request goes to a server holding its current version, named as the model.
    model, version = fleet.model_for(adapter)
    upstream = engine.pool.pick(affinity, frozenset(tried), adapter=model)
    tried.add(upstream)
    upstream.outstanding += 1
    upstream.served += 1
    if model is not None:
        fleet.acquire(upstream, model)
    try:
        yield upstream, model, version
    finally:
        upstream.outstanding -= 1
        if model is not None:
            fleet.release(upstream, model)


def _read_out(engine: RemoteEngine, upstream: Upstream, reading: Reading) -> None:
    """The answer was read to its end: it must have finished the request."""
    if not reading.finished:
        raise UpstreamFailed(f"The inference server {upstream.url} ended the stream before the request finished.")
    engine.intervals.finished(reading.tokens, upstream.streamed_at - reading.first_at)


def _failed(
    engine: RemoteEngine, upstream: Upstream, model: str | None, request_id: str, exc: Exception, *, streamed: bool
) -> None:
    """A request of ``engine`` to ``upstream`` failed with ``exc``: returns if another server may
    take it, raises what the client gets otherwise. ``streamed``: steps were handed out already."""
    if isinstance(exc, UpstreamFailed):
        # SGLang streams an unknown adapter as an error frame: "... not loaded: NAME@vN"
        if model is None or streamed or model not in exc.message:
            raise exc
        exc = _AdapterMissing(exc.message)
    if isinstance(exc, _AdapterMissing):  # the server lost it (restarted?): load it again, go elsewhere
        assert model is not None
        engine._fleet.lost(upstream, model)
        log.warning("request %s: %s does not hold %s (%s); trying another server",
                    request_id, upstream.url, model, exc)  # fmt: skip
    elif isinstance(exc, _Retry):
        engine.pool.mark_failed(upstream, str(exc))
        log.warning("request %s: %s failed before the first token (%s); trying another server",
                    request_id, upstream.url, exc)  # fmt: skip
    else:
        engine.pool.mark_failed(upstream, describe(exc))
        if streamed:
            raise UpstreamFailed(
                f"The inference server {upstream.url} failed while streaming: {describe(exc)}"
            ) from exc
        log.warning("request %s: %s unreachable (%s); trying another server",
                    request_id, upstream.url, describe(exc))  # fmt: skip


async def _reload_one(
    dialect: Dialect,
    pool: UpstreamPool,
    client: httpx.AsyncClient,
    upstream: Upstream,
    path: str,
    version: int,
    failures: dict[str, str],
) -> None:
    """Load the checkpoint ``path`` into one server as ``version`` (a failure noted in ``failures``
    and the server out of rotation until a check passes); while it loads, its checks are forgiven."""
    try:
        # Already serving it (another gateway, or another --workers process, loaded it): done.
        if await dialect.served_version(client, upstream.url) == str(version):
            return
        upstream.reloading = True
        await dialect.reload_weights(client, upstream.url, path, version)
    except (httpx.HTTPError, UpstreamFailed) as exc:
        failures[upstream.url] = describe(exc)
        pool.mark_failed(upstream, f"weights {version} not loaded: {describe(exc)}")
    finally:
        upstream.reloading = False


def _forgive_slow_check(upstream: Upstream, timeout: float) -> bool:
    """Whether a server that did not answer its check in time is busy rather than gone (counted in
    its ``slow_checks``, logged now and then): requests
    are in flight there and one of its streams read a step within ``BUSY_WINDOW_S``. Seen on a
    real vLLM saturated on two cores: ``/health`` waited seconds behind the streams it was
    sending us, its streams stalled for seconds at a time, and taking the pool's only server out
    of rotation turned that into 503s for every client while it served. A server with nothing
    in flight, or silent that long, fails its next slow check (and its streams' own read
    timeout ends those in flight on a server that hung). A server this gateway is loading weights
    into is busy too (seen: a real vLLM reloading answered its check late, the pool took its only
    server out, and the next request found none); the reload's own calls fail it if it is gone."""
    recent = time.monotonic() - upstream.streamed_at < BUSY_WINDOW_S
    if not (upstream.outstanding and recent) and not upstream.reloading:
        return False
    upstream.slow_checks += 1
    if upstream.slow_checks == 1 or upstream.slow_checks % 100 == 0:
        log.info("upstream %s did not answer its health check in %.1f s while streaming %d requests: kept "
                 "(%d such checks)", upstream.url, timeout, upstream.outstanding,
                 upstream.slow_checks)  # fmt: skip
    return True
