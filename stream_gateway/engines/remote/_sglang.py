"""SGLang's native ``POST /generate`` with input ids, streamed.

``input_ids``, ``sampling_params``, ``return_logprob``, ``top_logprobs_num``, ``stream``. Its
OpenAI endpoints drop token ids when streaming (sgl-project/sglang#30917, #37365), so the native
endpoint is the only exact one. Frames hold the output so far (its default) or, with
``--incremental-streaming-output``, the new part: both are read. A frame's numeric
``meta_info.weight_version`` labels its tokens.

Routes (``docs/moe.md``): base64 of raw little-endian int32 ids, ``meta_info.routed_experts`` on
``/generate``'s final frame (or ``sglext.routed_experts``, as its OpenAI endpoints send it,
possibly on a trailing ``choices: []`` frame), reshaped with the config's ``num_hidden_layers``
and ``num_experts_per_tok``.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from stream_gateway._errors import UpstreamFailed
from stream_gateway.engines._base import EngineStep, FinishReason, SamplingParams
from stream_gateway.engines.remote._dialect import Dialect, Exchange, StepReader
from stream_gateway.engines.remote._wire import by_version, finish_reason, numeric_version, top_from_pairs
from stream_gateway.sessions import wire_ids

if TYPE_CHECKING:
    import httpx

__all__ = ["SglangDialect"]

log = logging.getLogger(__name__)


class SglangDialect(Dialect):
    """SGLang's native ``/generate``."""

    engine = "sglang-http"
    generate_path = "/generate"
    load_adapter_path = "/load_lora_adapter"
    unload_adapter_path = "/unload_lora_adapter"
    routes_start_field = "routed_experts_start_len"

    def body(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, model: str, adapter: str | None
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
            "input_ids": wire_ids(prompt_ids),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "logprob_start_len": -1,
            "stream": True,
            "rid": request_id,
        }
        if adapter is not None:
            body["lora_path"] = adapter  # SGLang names a loaded adapter by its lora_name here
        return body

    def reader(self, exchange: Exchange) -> StepReader:
        return _SglangReader(exchange)

    async def model_path(self, client: httpx.AsyncClient, url: str) -> str | None:
        info = await client.get(f"{url}/get_model_info")
        if info.status_code != 200:
            return None
        path = orjson.loads(info.content).get("model_path")
        return str(path) if path else None


class _SglangReader(StepReader):
    """The frames that arrived together as one step per weight version; with routes asked for, the
    finishing step is held for the frame that carries them (until the stream ends)."""

    __slots__ = ("_exchange", "_seen")

    def __init__(self, exchange: Exchange) -> None:
        super().__init__()
        self._exchange = exchange
        self._seen = 0  # output tokens already taken

    def feed(self, events: list[dict[str, Any]]) -> list[EngineStep]:
        exchange = self._exchange
        url, top_n, wanted = exchange.url, exchange.top_n, exchange.wanted
        pieces: list[EngineStep] = []
        for event in events:
            raw = _raw_routes(event)
            if self.held is not None:  # a trailing frame (``choices: []`` with ``sglext``), or another
                if raw is not None:
                    pieces.append(_with_routes(self.held, raw, exchange, self._seen))
                    self.held, self.done = None, True
                    break
                continue
            meta = event.get("meta_info") or {}
            entries = meta.get("output_token_logprobs") or []
            top_entries = meta.get("output_top_logprobs") or []
            # Default frames hold everything so far; --incremental-streaming-output frames the new part.
            seen = self._seen
            cumulative = len(entries) == meta.get("completion_tokens", len(entries)) and len(entries) >= seen
            if cumulative:
                entries, top_entries = entries[seen:], top_entries[seen:] if top_entries else top_entries
            reason = _finish(meta.get("finish_reason"), url)
            if not entries and reason is None:
                continue
            self._seen = seen = seen + len(entries)
            top = tuple(top_from_pairs(t, top_n) for t in top_entries) if top_n else None
            version = exchange.adapter_version
            if version is None:
                version = numeric_version(meta.get("weight_version"))
            step = EngineStep(
                tuple(int(e[1]) for e in entries),
                tuple(float(e[0]) for e in entries),
                top if top else None,
                reason,
                version if version is not None else exchange.pool_version(),
            )
            if wanted is None or reason is None:
                pieces.append(step)
                self.done = reason is not None
            elif raw is not None:
                pieces.append(_with_routes(step, raw, exchange, seen))
                self.done = True
            else:
                self.held = step
            if self.done:
                break
        return by_version(pieces)

    def end(self) -> list[EngineStep]:
        held, self.held = self.held, None
        if held is None:
            return []
        self._exchange.routes.missing(self._exchange.url)  # the stream ended without them
        self.done = True
        return [held]


def _finish(finish: object, url: str) -> FinishReason | None:
    if finish is None:
        return None
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise UpstreamFailed(f"The inference server {url} aborted the request: {message or 'no reason given'}")
    return finish_reason(kind, url)


def _raw_routes(event: Mapping[str, Any]) -> object:
    """SGLang's routes in a frame: ``meta_info.routed_experts`` (``/generate``) or ``sglext.routed_experts``."""
    meta = event.get("meta_info")
    if isinstance(meta, dict) and meta.get("routed_experts") is not None:
        return meta["routed_experts"]
    ext = event.get("sglext")
    return ext.get("routed_experts") if isinstance(ext, dict) else None


def _with_routes(step: EngineStep, raw: object, exchange: Exchange, output: int) -> EngineStep:
    """The finishing step with SGLang's routes (raw int32 ids) on it."""
    config, wanted = exchange.routes.config, exchange.wanted
    if wanted is None or config is None:
        return step
    ids = _int32_routes(raw, config.layers, config.top_k, exchange.url)
    routes, start = exchange.routes.place(ids, wanted, output, exchange.url)
    return replace(step, routes=routes, routes_start=start)


def _int32_routes(value: object, layers: int, top_k: int, url: str) -> np.ndarray | None:
    """Base64 of raw little-endian int32 ids, ``[rows, layers, top_k]`` by the config."""
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
