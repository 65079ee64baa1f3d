"""Remote engines: the gateway renders and records, a pool of vLLM or SGLang servers samples.

``vllm-http`` and ``sglang-http`` keep everything the gateway does (chat template, token-exact
context, tool-call parsing, sessions, capture) on the gateway and send only token ids to the
servers, which answer with token ids and their logprobs. Nothing is re-tokenized on either side.

* **vLLM** (``POST /v1/completions``): ``prompt`` is the list of prompt ids; ``stream``,
  ``return_token_ids`` (the sampled ids of each chunk), ``logprobs`` (the sampled ids' logprobs,
  plus the ``k`` most likely alternatives), ``return_tokens_as_token_ids`` (alternatives keyed
  ``"token_id:N"``, never by text that may not round-trip) and ``skip_special_tokens: false``.
  ``return_weight_versions`` asks vLLM 0.33+ which weights sampled which output tokens (its
  ``weight_versions`` spans, on the last chunk; older servers ignore the field and log that
  they did). A stream-gateway serving ``/v1/completions`` speaks the same protocol, spans
  included, so gateways can be chained.
* **SGLang** (``POST /generate``): ``input_ids``, ``sampling_params``, ``return_logprob``,
  ``top_logprobs_num``, ``stream``. Its OpenAI endpoints drop token ids when streaming
  (sgl-project/sglang#30917, #37365), so the native endpoint is the only exact one. Frames hold
  the output so far (or, with ``--incremental-streaming-output``, the new part: both are read).

Which logprobs are recorded is the server's choice: vLLM returns ``--logprobs-mode``'s values,
``raw_logprobs`` (the model's distribution before temperature and top-k/top-p) by default; start
it with ``--logprobs-mode processed_logprobs`` to record, as the in-process engines do, the
distribution the tokens were drawn from. See ``docs/engines.md``.

Requests go to :class:`~._pool.UpstreamPool`'s pick (session affinity, then least outstanding).
A server that cannot be reached or answers 5xx before the first token is marked unhealthy and the
request tries the next healthy one; a server that fails after tokens were streamed ends that
stream with an :class:`~.._errors.EngineError` (the client gets an error frame, the turn is
recorded as aborted), since a half-sent answer cannot be replayed elsewhere. Closing the
generator closes the HTTP response, so the server sees the disconnect and aborts the request
(vLLM and SGLang both do).

Policy versions: these servers are updated by whoever trains (verl's rollout servers, an RL
framework's weight sync), not by the gateway. The gateway labels tokens with the version the
server reports when it does (vLLM 0.33+'s and a stream-gateway's numeric ``weight_versions``
spans, SGLang's numeric ``meta_info.weight_version``), and otherwise with the version announced
for the pool
(``policy.updated`` on NATS, or ``POST /policy/weights``): :meth:`RemoteEngine.load_weights`
records the announced version and never reads weights.

LoRA adapters (``docs/engines.md``): :meth:`RemoteEngine.load_adapter` loads version N of adapter
``NAME`` on every healthy server as the adapter ``NAME@vN`` (vLLM's ``/v1/load_lora_adapter``,
SGLang's ``/load_lora_adapter``; the directory must be readable by the servers at that path), so
no prefix cache computed under an older version is reused. Each server records which versioned
names it holds and how many requests are in flight on each (:class:`~._pool.Upstream`); a request
on an adapter names its current version as the model (SGLang: ``lora_path``) and goes only to a
server that holds it, and its steps carry the adapter's version. A server whose load failed takes
none of that adapter's requests until a retry (every 30 s) succeeds; older versions are unloaded
from a server once none of this engine's requests uses them there; a server added later, or one
that answers that it lacks the version (a restart), is given the current adapters again.

Routed experts (Rollout Routing Replay, ``docs/moe.md``): built with ``routed_experts=True`` and a
model whose config (``--model``, read for the tokenizer anyway) declares experts, the engine asks
every server for the experts that routed each position, and the last step of a request carries
them all (``EngineStep.routes``, from ``SamplingParams.routes_from`` when the server honoured
it: ``routes_start`` says). It sends ``return_routed_experts: true`` (SGLang's flag; vLLM turns
routes on per server with ``--enable-return-routed-experts``) and a start as
``routed_experts_start_len`` (SGLang) or ``routed_experts_prompt_start`` (vLLM 0.33+), and reads:

* vLLM-style, per choice: ``routed_experts``, base64 of ``.npy`` bytes ``[rows, layers, top_k]``
  on the final chunk. A stream-gateway upstream sends it there; vLLM itself sends it only on
  non-streamed responses and on its token-in generate API, not on streamed ``/v1/completions``
  (checked in 0.24 and 0.33), so a pool of vLLM servers gives no routes this way.
* SGLang: base64 of raw little-endian int32 ids, ``meta_info.routed_experts`` on ``/generate``'s
  final frame (or ``sglext.routed_experts``, as its OpenAI endpoints send it, possibly on a
  trailing ``choices: []`` frame), reshaped with the config's ``num_hidden_layers`` and
  ``num_experts_per_tok``.

Either way the ids become uint8 (at most 256 experts) or uint16, and rows must number
``prompt + output - 1`` less the start (or the whole, for a server that ignored the start);
anything else is logged and the request keeps no routes. A server that refuses the flag (a
stream-gateway serving a dense model, or one started with ``--no-routed-experts``: a 400 naming
``return_routed_experts``) is asked again without it, and no more for the life of this engine.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import httpx
import numpy as np
import orjson
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway._errors import EngineError, EngineUnavailable, GatewayError, InvalidRequest
from stream_gateway.engines._base import (
    EngineStatistics,
    EngineStep,
    ExpertShape,
    FinishReason,
    SamplingParams,
    WeightUpdateReport,
    merge_steps,
)
from stream_gateway.engines._pool import Upstream, UpstreamPool
from stream_gateway.engines._stream_http import HttpFailure, StreamClient, StreamResponse
from stream_gateway.moe import route_dtype

if TYPE_CHECKING:
    import torch
    from anyio.abc import TaskGroup

__all__ = ["PROTOCOLS", "RemoteEngine", "adapter_model"]

log = logging.getLogger(__name__)

Protocol = Literal["vllm", "sglang"]
PROTOCOLS: dict[str, Protocol] = {"vllm-http": "vllm", "sglang-http": "sglang"}

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "eos_token": "stop"}
# LoRA adapters: (load, unload) routes of vLLM (VLLM_ALLOW_RUNTIME_LORA_UPDATING) and SGLang
_ADAPTER_ROUTES: dict[Protocol, tuple[str, str]] = {
    "vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": ("/load_lora_adapter", "/unload_lora_adapter"),
}
_ADAPTER_RETRY_S = 30.0  # a server that failed to load an adapter version is asked again after this
_EXPERT_COUNT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts")  # as stream_gateway.moe reads them
_TOP_K_NAMES = ("num_experts_per_tok", "top_k")


@dataclass(frozen=True, slots=True)
class _Wanted:
    """What one request asked its server for: routes from ``start``, for a prompt of ``prompt`` ids."""

    prompt: int
    start: int


class UpstreamFailed(EngineError):
    """A server failed while serving a request (connection lost, error frame, bad answer)."""


class _Retry(Exception):
    """The server failed before sending anything: the request may go to another one."""


class _AdapterMissing(_Retry):
    """The server does not hold the LoRA adapter version the request named (it restarted, say)."""


class RemoteEngine:
    """Samples on a pool of vLLM (``vllm-http``) or SGLang (``sglang-http``) servers over HTTP."""

    remote = True
    constrained_decoding = False
    experts: ExpertShape | None = None
    vision: VisionProcessor | None = None  # text only (docs/images.md)

    @property
    def upstreams(self) -> RemoteEngine:
        """This engine is its own pool control (:class:`~._base.UpstreamControl`)."""
        return self

    def __init__(
        self,
        tokenizer: str | Path,
        *,
        protocol: Protocol,
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
    ) -> None:
        self.name = "vllm-http" if protocol == "vllm" else "sglang-http"
        self.protocol: Protocol = protocol
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
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(64, max_connections))
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None  # health checks, model info, adapters
        self._streams: StreamClient | None = None  # the generation requests (the per-token path)
        self._task_group: TaskGroup | None = None
        self._active = 0
        self._total_requests = 0
        self._total_tokens = 0
        self._routed_experts = routed_experts
        self._expert_config: ExpertShape | None = None  # the config's: layers are num_hidden_layers
        self._routeless: set[str] = set()  # servers that refused return_routed_experts
        self._silent: set[str] = set()  # servers that answered without routes (logged once each)
        # LoRA adapters (docs/engines.md): name -> current version, and the directory it was loaded from.
        self._adapter_versions: dict[str, int] = {}
        self.adapters: Mapping[str, int] = MappingProxyType(self._adapter_versions)
        self._adapter_paths: dict[str, str] = {}
        self._adapter_locks: dict[Upstream, anyio.Lock] = {}  # one load/unload at a time per server
        self._sync_pending: set[Upstream] = set()

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> RemoteEngine:
        self.tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, self._tokenizer_path)
        model_max = getattr(self.tokenizer, "model_max_length", 0) or 0
        self._fallback_len = int(model_max) if 0 < model_max < 10_000_000 else 4096
        self._update_max_model_len()
        if self._routed_experts:
            self._expert_config = await anyio.to_thread.run_sync(_expert_config, self._tokenizer_path)
            self.experts = self._expert_config  # until the first routes arrive and tell their shape
            if self._expert_config is None:
                log.info("%s: %s declares no experts: no routes asked for", self.name, self._tokenizer_path)
        self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits, headers=self._headers)
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
        await self.check_all()  # the first requests find the healthy servers already known
        self._task_group.start_soon(self._health_loop)
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
            if upstream.healthy and self._adapter_versions:
                await self._sync_adapters(upstream)  # the current adapters, before the reply
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
        """One health check: ``GET /health`` must answer 200; learn the served model once."""
        assert self._client is not None
        try:
            with anyio.fail_after(self._health_timeout):
                response = await self._client.get(f"{upstream.url}/health")
                if response.status_code != 200:
                    raise UpstreamFailed(f"/health answered {response.status_code}")
                if upstream.model is None:
                    await self._learn_model(upstream)
                    self._update_max_model_len()
        except (httpx.HTTPError, UpstreamFailed, TimeoutError, ValueError, KeyError, TypeError) as exc:
            self.pool.mark_failed(upstream, _describe(exc))
            return
        except Exception as exc:  # a check must never end the checks (and the engine with them)
            # Seen in CI: a connection to a server that had just been restarted, reset between connect and
            # httpcore's first look at it, raised AttributeError from anyio's socket attributes (the
            # transport had already dropped its socket; anyio 4.16, httpcore 1.0.9). A server answering
            # /v1/models with a JSON list did the same from our own parsing.
            log.warning("health check of %s failed unexpectedly", upstream.url, exc_info=True)
            self.pool.mark_failed(upstream, _describe(exc))
            return
        self.pool.mark_healthy(upstream)

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
        if self.protocol == "sglang":
            info = await self._client.get(f"{upstream.url}/get_model_info")
            if info.status_code == 200:
                upstream.model = str(orjson.loads(info.content).get("model_path") or self.model_id)
                return
        raise UpstreamFailed(f"/v1/models answered {response.status_code}")

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(self._health_interval)
            await self.check_all()
            for upstream in self.pool:
                if upstream.healthy and self._adapters_out_of_date(upstream):
                    self._schedule_sync(upstream)

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
        """Stream one request from a healthy server (failing over until the first token arrives)."""
        if images:  # the preparer refuses them first (vision is None): never sample without them
            raise EngineError(f"the {self.name} engine does not take images")
        if self._client is None:
            raise EngineUnavailable("The engine is not running.")
        self._active += 1
        self._total_requests += 1
        tried: set[Upstream] = set()
        try:
            while True:
                # A LoRA adapter's request goes to a server holding its current version, named as the model.
                model, version = self._adapter_model(params.adapter)
                upstream = self.pool.pick(affinity, frozenset(tried), adapter=model)
                tried.add(upstream)
                upstream.outstanding += 1
                upstream.served += 1
                if model is not None:  # counted from the pick on: an old version is unloaded only once idle
                    upstream.adapter_requests[model] = upstream.adapter_requests.get(model, 0) + 1
                started = False
                try:
                    stream = self._stream(upstream, request_id, prompt_ids, params, model, version)
                    async with aclosing(stream) as steps:
                        async for step in steps:
                            started = True
                            self._total_tokens += len(step.token_ids)
                            yield step
                    return
                except _AdapterMissing as exc:  # the server lost it (restarted?): load it again, go elsewhere
                    assert model is not None
                    upstream.adapters.discard(model)
                    self._schedule_sync(upstream)
                    log.warning("request %s: %s does not hold %s (%s); trying another server",
                                request_id, upstream.url, model, exc)  # fmt: skip
                except _Retry as exc:
                    self.pool.mark_failed(upstream, str(exc))
                    log.warning("request %s: %s failed before the first token (%s); trying another server",
                                request_id, upstream.url, exc)  # fmt: skip
                except (httpx.HTTPError, HttpFailure) as exc:
                    self.pool.mark_failed(upstream, _describe(exc))
                    if started:
                        raise UpstreamFailed(
                            f"The inference server {upstream.url} failed while streaming: {_describe(exc)}"
                        ) from exc
                    log.warning("request %s: %s unreachable (%s); trying another server",
                                request_id, upstream.url, _describe(exc))  # fmt: skip
                finally:
                    upstream.outstanding -= 1
                    if model is not None:
                        self._release(upstream, model)
        finally:
            self._active -= 1

    async def _stream(
        self,
        upstream: Upstream,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        model: str | None = None,
        version: int | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        wanted = None
        if self._expert_config is not None and upstream.url not in self._routeless:
            wanted = _Wanted(len(prompt_ids), params.routes_from)
        path = "/v1/completions" if self.protocol == "vllm" else "/generate"
        read = self._vllm_steps if self.protocol == "vllm" else self._sglang_steps
        response = await self._send(upstream, path, request_id, prompt_ids, params, wanted, model)
        try:
            if response.status_code == 400 and wanted is not None:
                await response.aread()
                if _error_param(response.content) == "return_routed_experts":
                    self._routeless.add(upstream.url)
                    log.warning("%s refuses return_routed_experts (%s): asking it for no routes from now on",
                                upstream.url, _error_message(response.content))  # fmt: skip
                    await response.aclose()
                    wanted = None
                    response = await self._send(upstream, path, request_id, prompt_ids, params, None, model)
            if response.status_code != 200:
                await response.aread()
                message = _error_message(response.content) or f"HTTP {response.status_code}"
                if model is not None and response.status_code in (400, 404) and model in message:
                    # vLLM: 404 "The model `NAME@vN` does not exist."; SGLang: 400 "... not loaded: NAME@vN"
                    raise _AdapterMissing(f"{upstream.url}{path} answered {response.status_code}: {message}")
                if response.status_code >= 500 or response.status_code in (404, 408, 429):
                    raise _Retry(f"{upstream.url}{path} answered {response.status_code}: {message}")
                raise InvalidRequest(f"The inference server refused the request: {message}")
            finished = False
            steps_read = read(_sse_batches(response), params.top_logprobs, upstream.url, wanted, version)
            sent = False
            try:
                async with aclosing(steps_read) as steps:
                    async for step in steps:
                        finished = step.finish_reason is not None
                        sent = True
                        yield step
                        if finished:
                            return
            except UpstreamFailed as exc:
                # SGLang streams an unknown adapter as an error frame: "... not loaded: NAME@vN"
                if model is not None and not sent and model in exc.message:
                    raise _AdapterMissing(exc.message) from exc
                raise
            if not finished:
                raise UpstreamFailed(
                    f"The inference server {upstream.url} ended the stream before the request finished."
                )
        finally:
            await response.aclose()

    async def _send(
        self,
        upstream: Upstream,
        path: str,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        wanted: _Wanted | None,
        model: str | None = None,
    ) -> StreamResponse:
        assert self._streams is not None
        if self.protocol == "vllm":
            body = self._vllm_body(upstream, request_id, prompt_ids, params, model)
        else:
            body = self._sglang_body(request_id, prompt_ids, params, model)
        if wanted is not None:
            body["return_routed_experts"] = True
            if wanted.start:
                body["routed_experts_prompt_start" if self.protocol == "vllm" else "routed_experts_start_len"] = (
                    wanted.start
                )
        return await self._streams.post(upstream.url + path, orjson.dumps(body))

    def _routes(self, ids: np.ndarray | None, wanted: _Wanted, output: int, url: str) -> tuple[np.ndarray | None, int]:
        """A server's routes checked, narrowed and placed: ``(rows, position of the first)``."""
        config = self._expert_config
        if config is None:
            return None, 0
        if ids is None:
            self._no_routes(url)
            return None, 0
        if ids.ndim != 3 or (ids.size and (int(ids.min()) < 0 or int(ids.max()) >= config.num_experts)):
            log.warning("%s sent routes of shape %s or outside [0, %d): not kept", url, ids.shape, config.num_experts)
            return None, 0
        whole = wanted.prompt + output - 1
        if len(ids) == whole - wanted.start:
            start = wanted.start
        elif len(ids) == whole:
            start = 0  # the server ignored the start (vLLM before 0.33)
        else:
            log.warning("%s sent %d rows of routes for %d positions from %d: not kept",
                        url, len(ids), whole, wanted.start)  # fmt: skip
            return None, 0
        layers, top_k = ids.shape[1], ids.shape[2]
        if self.experts is None or (self.experts.layers, self.experts.top_k) != (layers, top_k):
            self.experts = ExpertShape(layers, top_k, config.num_experts)
        return ids.astype(route_dtype(config.num_experts), copy=False), start

    # -- vLLM ---------------------------------------------------------------------------------

    def _vllm_body(
        self,
        upstream: Upstream,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        model: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model or upstream.model or self.model_id,  # a LoRA adapter is served as a model
            "prompt": list(prompt_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": params.top_logprobs,
            "stream": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "return_weight_versions": True,
            "skip_special_tokens": False,
            "ignore_eos": params.ignore_eos,
            "request_id": request_id,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop_token_ids:
            body["stop_token_ids"] = sorted(params.stop_token_ids)
        return body

    async def _vllm_steps(
        self,
        batches: AsyncIterator[list[dict[str, Any]]],
        top_n: int,
        url: str,
        wanted: _Wanted | None,
        adapter_version: int | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        """Steps of a ``/v1/completions`` stream, one per batch of frames that arrived together; a
        LoRA adapter's carry ``adapter_version`` (the server's own labels count the base's
        versions, or its own of the adapter: both ignored)."""
        output = 0
        version = self.policy_version if adapter_version is None else adapter_version
        async for batch in batches:
            pieces: list[EngineStep] = []
            for event in batch:
                choices = event.get("choices")
                if not choices:
                    continue  # a usage-only frame
                choice = choices[0]
                reason = _finish_reason(choice.get("finish_reason"), url)
                logprobs = choice.get("logprobs") or {}
                ids = choice.get("token_ids")
                if ids is None:  # an older server: the ids are in the tokens ("token_id:N")
                    ids = [_token_id(t) for t in logprobs.get("tokens") or ()]
                values = logprobs.get("token_logprobs") or ()
                if len(values) != len(ids):
                    raise UpstreamFailed(
                        f"The inference server {url} sent {len(ids)} token ids with {len(values)} logprobs; "
                        "it must return both (logprobs and return_token_ids)."
                    )
                if not ids and reason is None:
                    continue  # the first frame may carry the prompt ids alone
                top: tuple[tuple[tuple[int, float], ...], ...] | None = None
                if top_n:
                    top = tuple(_top_from_dict(entry, top_n) for entry in logprobs.get("top_logprobs") or ())
                output += len(ids)
                routes, routes_start = None, 0
                if wanted is not None and reason is not None:
                    raw = _npy_routes(choice.get("routed_experts"), url)
                    routes, routes_start = self._routes(raw, wanted, output, url)
                pieces.append(
                    EngineStep(
                        tuple(ids),
                        tuple(values) if None not in values else tuple(-9999.0 if v is None else v for v in values),
                        top,
                        reason,
                        version,
                        _version_spans(choice.get("weight_versions")) if adapter_version is None else None,
                        routes,
                        routes_start,
                    )
                )
                if reason is not None:
                    break  # what follows is the usage frame
            if pieces:
                yield pieces[0] if len(pieces) == 1 else merge_steps(pieces)

    # -- SGLang -------------------------------------------------------------------------------

    def _sglang_body(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, model: str | None = None
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "skip_special_tokens": False,
            "ignore_eos": params.ignore_eos,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = sorted(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body: dict[str, Any] = {
            "input_ids": list(prompt_ids),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "logprob_start_len": -1,
            "stream": True,
            "rid": request_id,
        }
        if model is not None:
            body["lora_path"] = model  # SGLang names a loaded adapter by its lora_name here
        return body

    async def _sglang_steps(
        self,
        batches: AsyncIterator[list[dict[str, Any]]],
        top_n: int,
        url: str,
        wanted: _Wanted | None,
        adapter_version: int | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        """Steps of a ``/generate`` stream: the frames that arrived together as one step per weight version."""
        seen = 0  # output tokens already taken
        last: EngineStep | None = None  # the finishing step, held for routes that come after it
        async for batch in batches:
            pieces: list[EngineStep] = []
            ended = False
            for event in batch:
                raw = _sglang_raw_routes(event)
                if last is not None:  # a trailing frame (``choices: []`` with ``sglext``), or another
                    if raw is not None:
                        pieces.append(self._with_routes(last, raw, wanted, seen, url))
                        ended = True
                        break
                    continue
                meta = event.get("meta_info") or {}
                entries = meta.get("output_token_logprobs") or []
                top_entries = meta.get("output_top_logprobs") or []
                # Default frames hold everything so far; --incremental-streaming-output frames the new part.
                cumulative = len(entries) == meta.get("completion_tokens", len(entries)) and len(entries) >= seen
                if cumulative:
                    entries, top_entries = entries[seen:], top_entries[seen:] if top_entries else top_entries
                reason = _sglang_finish(meta.get("finish_reason"), url)
                if not entries and reason is None:
                    continue
                seen += len(entries)
                top = tuple(_top_from_sglang(t, top_n) for t in top_entries) if top_n else None
                version = _numeric_version(meta.get("weight_version")) if adapter_version is None else adapter_version
                step = EngineStep(
                    tuple(int(e[1]) for e in entries),
                    tuple(float(e[0]) for e in entries),
                    top if top else None,
                    reason,
                    version if version is not None else self.policy_version,
                )
                if wanted is None or reason is None:
                    pieces.append(step)
                    ended = reason is not None
                elif raw is not None:
                    pieces.append(self._with_routes(step, raw, wanted, seen, url))
                    ended = True
                else:
                    last = step
                if ended:
                    break
            for step in _by_version(pieces):
                yield step
            if ended:
                return
        if last is not None:  # the stream ended without them
            self._no_routes(url)
            yield last

    def _no_routes(self, url: str) -> None:
        if url not in self._silent:
            self._silent.add(url)
            log.warning("%s sent no routed experts for a request that asked for them (logged once per server; "
                        "vLLM sends none on streamed completions; SGLang needs --enable-return-routed-experts)",
                        url)  # fmt: skip

    def _with_routes(self, step: EngineStep, raw: object, wanted: _Wanted | None, output: int, url: str) -> EngineStep:
        """The finishing step with SGLang's routes (raw int32 ids) on it."""
        config = self._expert_config
        if wanted is None or config is None:
            return step
        ids = _int32_routes(raw, config.layers, config.top_k, url)
        routes, start = self._routes(ids, wanted, output, url)
        return replace(step, routes=routes, routes_start=start)

    # -- LoRA adapters --------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str, policy_version: int) -> WeightUpdateReport:
        """Load the PEFT adapter directory ``path`` as version ``policy_version`` of LoRA adapter
        ``name`` on every healthy server, as the adapter ``NAME@vN`` (vLLM's ``/v1/load_lora_adapter``,
        SGLang's ``/load_lora_adapter``); ``path`` must be readable by the servers themselves.

        A server that failed to load it takes no request of ``name`` until it holds this version
        (asked again every 30 s, and a server added later or back from failing is brought up to
        date); the others serve them at once, and each unloads the older versions once none of
        this engine's requests uses them. Raises :class:`~stream_gateway.lora.AdapterRefused` when
        no server loaded it (the current version stays), :class:`EngineUnavailable` with no
        healthy server.
        """
        from stream_gateway.lora import AdapterRefused

        if self._client is None:
            raise EngineUnavailable("The engine is not running.")
        model = adapter_model(name, policy_version)
        targets = [u for u in self.pool if u.healthy]
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
        previous = self._adapter_versions.get(name, 0)
        self._adapter_versions[name] = policy_version
        self._adapter_paths[name] = path
        loaded_s = time.perf_counter() - started
        in_flight = 0
        for upstream in self.pool:
            for held in list(upstream.adapter_failures):  # older versions' failures no longer matter
                if held != model and _adapter_of(held) == name:
                    del upstream.adapter_failures[held]
            in_flight += sum(n for held, n in upstream.adapter_requests.items() if _adapter_of(held) == name)
            if self._adapters_out_of_date(upstream):
                self._schedule_sync(upstream)  # unload the versions before, where idle
        log.info("adapter %s %d -> %d: loaded as %s on %d of %d servers in %.2f s%s",
                 name, previous, policy_version, model, len(targets) - len(refused), len(targets), loaded_s,
                 f" (refused by {', '.join(refused)})" if refused else "")  # fmt: skip
        return WeightUpdateReport(policy_version, previous, 0, loaded_s, 0.0, in_flight)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name``: requests in flight on it finish, and each server
        unloads its versions once idle. KeyError for a name not loaded."""
        del self._adapter_versions[name]
        self._adapter_paths.pop(name, None)
        for upstream in self.pool:
            for model in list(upstream.adapter_failures):
                if _adapter_of(model) == name:
                    del upstream.adapter_failures[model]
            if self._adapters_out_of_date(upstream):
                self._schedule_sync(upstream)

    def _adapter_model(self, adapter: str | None) -> tuple[str | None, int | None]:
        """The versioned model name a request on ``adapter`` names now, and that version."""
        if adapter is None:
            return None, None
        version = self._adapter_versions.get(adapter)
        if version is None:
            raise EngineUnavailable(f"The LoRA adapter {adapter} is not loaded on the inference servers.")
        return adapter_model(adapter, version), version

    def _current_models(self) -> set[str]:
        return {adapter_model(name, version) for name, version in self._adapter_versions.items()}

    def _adapters_out_of_date(self, upstream: Upstream) -> bool:
        """A current version missing there (not failed lately), or an older one idle there."""
        current, now = self._current_models(), time.monotonic()
        for model in current:
            failed = upstream.adapter_failures.get(model)
            if model not in upstream.adapters and (failed is None or now - failed[0] >= _ADAPTER_RETRY_S):
                return True
        return any(model not in current and not upstream.adapter_requests.get(model) for model in upstream.adapters)

    def _release(self, upstream: Upstream, model: str) -> None:
        """A request on ``model`` there is done; unload an old version once it is idle."""
        left = upstream.adapter_requests.get(model, 0) - 1
        if left > 0:
            upstream.adapter_requests[model] = left
            return
        upstream.adapter_requests.pop(model, None)
        if model in upstream.adapters and model not in self._current_models():
            self._schedule_sync(upstream)

    def _schedule_sync(self, upstream: Upstream) -> None:
        if self._task_group is None or upstream in self._sync_pending:
            return
        self._sync_pending.add(upstream)
        self._task_group.start_soon(self._sync_adapters, upstream)

    async def _sync_adapters(self, upstream: Upstream) -> None:
        """Load the current adapter versions a server lacks, and unload its idle old ones."""
        self._sync_pending.discard(upstream)
        if upstream.removed or not upstream.healthy:
            return
        try:
            now = time.monotonic()
            for name, version in list(self._adapter_versions.items()):
                model, path = adapter_model(name, version), self._adapter_paths.get(name)
                failed = upstream.adapter_failures.get(model)
                if path is None or model in upstream.adapters or (failed and now - failed[0] < _ADAPTER_RETRY_S):
                    continue
                if self._adapter_versions.get(name) == version:  # not replaced or unloaded meanwhile
                    await self._load_on(upstream, model, path)
            current = self._current_models()
            for model in sorted(upstream.adapters - current):
                if not upstream.adapter_requests.get(model):
                    await self._unload_on(upstream, model)
        except Exception:  # never let it take the health checks down with it
            log.exception("%s: bringing its LoRA adapters up to date failed", upstream.url)

    def _adapter_lock(self, upstream: Upstream) -> anyio.Lock:
        lock = self._adapter_locks.get(upstream)
        if lock is None:
            lock = self._adapter_locks[upstream] = anyio.Lock()
        return lock

    async def _load_on(self, upstream: Upstream, model: str, path: str) -> tuple[int, str] | None:
        """Load adapter ``model`` from ``path`` on one server: ``None`` once it holds it, else
        ``(HTTP status or 0, why)``, recorded as the server's failure."""
        assert self._client is not None
        async with self._adapter_lock(upstream):
            if model in upstream.adapters:
                return None
            route = _ADAPTER_ROUTES[self.protocol][0]
            try:
                response = await self._client.post(upstream.url + route, json={"lora_name": model, "lora_path": path})
                status, message = response.status_code, _error_message(response.content) or ""
            except httpx.HTTPError as exc:
                status, message = 0, _describe(exc)
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
        async with self._adapter_lock(upstream):
            if model not in upstream.adapters or upstream.adapter_requests.get(model):
                return
            route = _ADAPTER_ROUTES[self.protocol][1]
            try:
                response = await self._client.post(upstream.url + route, json={"lora_name": model})
                status, message = response.status_code, _error_message(response.content) or ""
            except httpx.HTTPError as exc:
                log.warning("%s: unloading LoRA adapter %s failed (%s); asking again later",
                            upstream.url, model, _describe(exc))  # fmt: skip
                return
            if status == 200 or status == 404 or (status == 400 and model in message):  # gone already
                upstream.adapters.discard(model)
                log.info("%s unloaded LoRA adapter %s", upstream.url, model)
            else:
                log.warning("%s: unloading LoRA adapter %s answered %d (%s); asking again later",
                            upstream.url, model, status, message)  # fmt: skip

    # -- weights and statistics ---------------------------------------------------------------

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """The servers' weights are not the gateway's to change: record the announced version."""
        return self._announce(policy_version, len(tensors))

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """Record ``policy_version`` as the version the servers now serve (``path`` is not read).

        Whoever trains updates the servers (verl's rollout servers, SGLang's
        ``/update_weights_from_disk``) and then announces the version to the gateway.
        """
        return self._announce(policy_version, 0)

    def _announce(self, policy_version: int, tensors: int) -> WeightUpdateReport:
        started = time.perf_counter()
        previous, self.policy_version = self.policy_version, policy_version
        pause = time.perf_counter() - started
        return WeightUpdateReport(policy_version, previous, tensors, pause, pause, self._active)

    def statistics(self) -> EngineStatistics:
        """A snapshot of the requests in flight; ``running`` while any server is healthy."""
        running = self._client is not None and any(u.healthy for u in self.pool)
        return EngineStatistics(self._active, 0, self._total_requests, self._total_tokens, running)


async def _sse_batches(response: StreamResponse) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON ``data:`` payloads of an SSE response until ``[DONE]``, as lists of those that arrived
    together (one read); error payloads raise."""
    buffer = b""
    loads = orjson.loads
    while (chunk := await response.read()) is not None:
        # The common case, one whole ``data:`` frame per read (a token a frame): no splitting.
        if not buffer and chunk.startswith(b"data: {") and chunk.find(b"\n\n") == len(chunk) - 2:
            try:
                event = loads(chunk[6:])
            except orjson.JSONDecodeError as exc:
                raise UpstreamFailed(f"The inference server sent an unreadable frame: {chunk[:200]!r}") from exc
            if "error" in event or event.get("object") == "error":
                message = _error_message(chunk[6:]) or "unknown error"
                raise UpstreamFailed(f"The inference server {response.where} failed: {message}")
            yield [event]
            continue
        buffer = buffer + chunk if buffer else chunk
        if b"\n\n" not in buffer:
            continue
        blocks = buffer.split(b"\n\n")
        buffer = blocks.pop()  # the unfinished rest
        events: list[dict[str, Any]] = []
        for block in blocks:
            for line in block.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (keep-alives), event names, ids
                data = line[5:].strip()
                if data == b"[DONE]":
                    if events:
                        yield events
                    return
                try:
                    event = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise UpstreamFailed(f"The inference server sent an unreadable frame: {data[:200]!r}") from exc
                if "error" in event or event.get("object") == "error":
                    message = _error_message(data) or "unknown error"
                    raise UpstreamFailed(f"The inference server {response.where} failed: {message}")
                events.append(event)
        if events:
            yield events


def _by_version(pieces: list[EngineStep]) -> list[EngineStep]:
    """Steps that arrived together, merged where consecutive ones were sampled by one weight version."""
    if len(pieces) < 2:
        return pieces
    merged: list[EngineStep] = []
    start = 0
    for i in range(1, len(pieces) + 1):
        if i == len(pieces) or pieces[i].policy_version != pieces[start].policy_version:
            group = pieces[start:i]
            merged.append(group[0] if len(group) == 1 else merge_steps(group))
            start = i
    return merged


def adapter_model(name: str, version: int) -> str:
    """The model name of version ``version`` of LoRA adapter ``name`` on the servers: ``NAME@vN``.

    A new version is a new name there, so no server reuses for it a prefix cache computed under
    an older one (huggingface/trl#7017 names its adapter versions the same way)."""
    return f"{name}@v{version}"


def _adapter_of(model: str) -> str:
    """The adapter name of a versioned model name (``NAME@vN`` -> ``NAME``)."""
    return model.rsplit("@v", 1)[0]


def _expert_config(path: str) -> ExpertShape | None:
    """``num_hidden_layers``, top-k and expert count from the model's config; ``None``: no experts
    declared (a dense model), or no config to read."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        log.info("no model config at %s (%s)", path, exc)
        return None
    get_text_config = getattr(config, "get_text_config", None)
    config = get_text_config() if callable(get_text_config) else config

    def positive(names: tuple[str, ...]) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    experts, top_k, layers = positive(_EXPERT_COUNT_NAMES), positive(_TOP_K_NAMES), positive(("num_hidden_layers",))
    if experts is None or top_k is None or layers is None:
        return None
    return ExpertShape(layers, top_k, experts)


def _npy_routes(value: object, url: str) -> np.ndarray | None:
    """vLLM's ``routed_experts``: base64 of ``.npy`` bytes (``None`` when absent; unreadable: logged)."""
    if value is None:
        return None
    try:
        ids = np.load(io.BytesIO(base64.b64decode(str(value), validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        log.warning("%s sent unreadable routed experts: %s", url, exc)
        return None
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        log.warning("%s sent routed experts that are not integer ids", url)
        return None
    return ids


def _sglang_raw_routes(event: Mapping[str, Any]) -> object:
    """SGLang's routes in a frame: ``meta_info.routed_experts`` (``/generate``) or ``sglext.routed_experts``."""
    meta = event.get("meta_info")
    if isinstance(meta, dict) and meta.get("routed_experts") is not None:
        return meta["routed_experts"]
    ext = event.get("sglext")
    return ext.get("routed_experts") if isinstance(ext, dict) else None


def _int32_routes(value: object, layers: int, top_k: int, url: str) -> np.ndarray | None:
    """SGLang's routes: base64 of raw little-endian int32 ids, ``[rows, layers, top_k]`` by the config."""
    try:
        raw = base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as exc:
        log.warning("%s sent unreadable routed experts: %s", url, exc)
        return None
    if len(raw) % (4 * layers * top_k):
        log.warning("%s sent %d bytes of routed experts: not rows of %d layers x top-%d int32 ids",
                    url, len(raw), layers, top_k)  # fmt: skip
        return None
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k)


def _error_param(raw: bytes) -> str | None:
    """The ``param`` of an OpenAI-style error body."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


def _error_message(raw: bytes) -> str | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:300].decode("utf-8", "replace") or None
    if not isinstance(body, dict):
        return None
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


def _finish_reason(finish: object, url: str) -> FinishReason | None:
    if finish is None:
        return None
    reason = _FINISH.get(str(finish))
    if reason is None:
        raise UpstreamFailed(f"The inference server {url} ended the request with finish_reason {finish!r}.")
    return reason


def _sglang_finish(finish: object, url: str) -> FinishReason | None:
    if finish is None:
        return None
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise UpstreamFailed(f"The inference server {url} aborted the request: {message or 'no reason given'}")
    return _finish_reason(kind, url)


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise UpstreamFailed("the server must return tokens as token ids (return_tokens_as_token_ids)")
    return int(token[9:])


def _top_from_dict(entry: Mapping[str, float] | None, n: int) -> tuple[tuple[int, float], ...]:
    if not entry:
        return ()
    pairs = sorted(((_token_id(k), float(v)) for k, v in entry.items()), key=lambda p: -p[1])
    return tuple(pairs[:n])


def _top_from_sglang(entry: Sequence[Sequence[Any]] | None, n: int) -> tuple[tuple[int, float], ...]:
    if not entry:
        return ()
    return tuple((int(e[1]), float(e[0])) for e in entry[:n])


def _version_spans(spans: object) -> tuple[tuple[int, int], ...] | None:
    """vLLM's ``weight_versions`` (``[{"version", "start", "end"}]``) as ``(version, first index)``
    spans, if every label is a version number; otherwise ``None`` (the pool's version stands)."""
    if not isinstance(spans, list) or not spans:
        return None
    out = []
    for span in spans:
        version = _numeric_version(span.get("version")) if isinstance(span, dict) else None
        if version is None:
            return None
        out.append((version, int(span.get("start", 0))))
    return tuple(out)


def _numeric_version(value: object) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, GatewayError):
        return exc.message
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
