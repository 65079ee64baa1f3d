"""vLLM's token-in API: ``POST /v1/completions`` with token-id prompts, served by any engine.

RL frameworks that keep their own token ids (verl's agent loop, rLLM's cumulative mode, SkyRL,
NeMo-Gym) call vLLM's ``/v1/completions`` with ``prompt`` as a list of ids and read the sampled
ids back (``return_token_ids``). This module speaks that protocol on the gateway, so those
frameworks can use any engine of ours, and so the ``vllm-http`` engine has a real server to talk
to here. Request and response shapes follow vLLM's OpenAI server (``CompletionRequest``,
``CompletionStreamResponse``, ``CompletionResponse``, ``CompletionLogProbs``; see
``docs/http-api.md`` for the field-by-field comparison and the vLLM version it was checked against).

Token-in turns are turns like any other: recorded in a session, captured as events, with the
exact prompt ids given and the sampled ids and logprobs. A prompt that starts with a finished
turn's prompt and output ids continues that turn (its parent; ``reused_prompt_tokens`` is that
prefix's length), found within the named session or, without one, among the tenant's sessions.
Token-in turns are not continued by chat requests (there are no messages to recognise them by).

Policy versions the way vLLM (0.33) reports them: with ``return_weight_versions`` each choice's
last chunk (and each non-streamed choice) has ``weight_versions``, ``[{"version": "3", "start": 0,
"end": 12}]``: which weights sampled which half-open range of its output tokens. A ``vllm-http``
gateway in front of this one (or of vLLM 0.33+) records them per token.

Routed experts of a mixture of experts (Rollout Routing Replay, ``docs/moe.md``) the way vLLM
writes them: with ``return_routed_experts`` (SGLang's request flag; vLLM turns them on per server)
each choice's last chunk (and each non-streamed choice) has ``routed_experts``, base64 of the
``.npy`` bytes of a ``[prompt + output - 1, layers, top_k]`` uint8/uint16 array (``np.load``
reads it back), as vLLM's non-streamed completions and its token-in generate API's final chunks
carry it. ``routed_experts_start_len`` (SGLang) or ``routed_experts_prompt_start`` (vLLM 0.33)
drops the rows of the positions before it. A ``vllm-http`` gateway in front of this one asks for
them and records them for its own turns.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from stream_gateway._errors import GatewayError, InvalidRequest, UnsupportedParameter
from stream_gateway.completion import (
    MAX_STOP_SEQUENCES,
    ChoiceResult,
    ChoiceUpdate,
    KeptHistory,
    PreparedCompletion,
    SamplingRequest,
    StreamOptions,
    TokenInRequest,
    TokenText,
    null_is_absent,
)
from stream_gateway.protocols._chat import DONE_FRAME, frame_head, usage_body
from stream_gateway.protocols._edge import Call, EdgeBase, StreamStart

__all__ = ["CompletionRequest", "TextChunkEncoder", "TokenInEdge", "text_completion_body"]

MAX_LOGPROBS = 20

TokenIds = Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]


class CompletionRequest(BaseModel):
    """``POST /v1/completions``, as vLLM accepts it (the fields that matter for sampling)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        # null means "not given", except for max_tokens: vLLM reads null there as "up to the context".
        if isinstance(data, dict) and data.get("max_tokens", 0) is None:
            return {**null_is_absent({k: v for k, v in data.items() if k != "max_tokens"}), "max_tokens": None}
        return null_is_absent(data)

    model: str
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool = False
    return_routed_experts: bool = False  # SGLang's flag (vLLM: a server setting); per choice, vLLM's format
    routed_experts_start_len: Annotated[int, Field(ge=0)] | None = None  # SGLang's name: rows from there
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] | None = None  # vLLM 0.33's name, the same
    ignore_eos: bool = False
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    session_id: str | None = None  # vLLM's session identity: here the session the turn joins
    # vLLM 0.32+'s fewest tokens a streamed chunk: a front's hint (engines/remote/_interval.py) that
    # changes no token; this gateway's chunks follow its own coalescing (docs/performance.md).
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    # Change nothing here, or only when set to other than their no-op values (checked below).
    user: str | None = None
    request_id: str | None = None
    priority: int | None = None
    cache_salt: str | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # The body's kept history (completion/_kept.py KeptHistory), set by the store that read it: its
    # prompt ids, kept, and the turn they made.
    _history: Any = PrivateAttr(default=None)

    def check_supported(self) -> None:
        """Refuse what would change the output but is not implemented (never silently ignored)."""
        if self.echo:
            raise UnsupportedParameter("echo is not supported; the prompt is not repeated", param="echo")
        if self.suffix:
            raise UnsupportedParameter("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter("best_of is not supported", param="best_of")
        for name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens", "prompt_logprobs"):
            if getattr(self, name):
                raise UnsupportedParameter(f"{name} is not supported", param=name)
        if self.repetition_penalty not in (None, 1.0):
            raise UnsupportedParameter("repetition_penalty is not supported", param="repetition_penalty")
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias is not supported", param="logit_bias")
        if self.include_stop_str_in_output:
            raise UnsupportedParameter(
                "include_stop_str_in_output is not supported", param="include_stop_str_in_output"
            )
        if self.priority:
            raise UnsupportedParameter("priority is not supported", param="priority")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        starts = {self.routed_experts_start_len, self.routed_experts_prompt_start} - {None}
        if len(starts) > 1:
            raise InvalidRequest(
                "routed_experts_start_len and routed_experts_prompt_start name one start; they differ",
                param="routed_experts_prompt_start",
            )

    def routes_start(self) -> tuple[int, str]:
        """The first position whose routes to return, and the name the client gave it."""
        if self.routed_experts_prompt_start is not None:
            return self.routed_experts_prompt_start, "routed_experts_prompt_start"
        return self.routed_experts_start_len or 0, "routed_experts_start_len"

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)  # type: ignore[arg-type]

    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class TextChunkEncoder:
    """Frames of a streamed ``text_completion`` in vLLM's shape."""

    __slots__ = (
        "_as_ids",
        "_counts",
        "_head",
        "_logprobs",
        "_offsets",
        "_prompts",
        "_routes",
        "_token_ids",
        "_token_text",
        "_versions",
    )

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        *,
        token_text: TokenText,
        logprobs: bool,
        token_ids: bool,
        tokens_as_ids: bool,
        weight_versions: bool,
        prompts: dict[int, Sequence[int]],
        routed_experts: bool = False,
    ) -> None:
        self._head = frame_head(completion_id, "text_completion", created, model)
        self._versions = weight_versions
        self._counts: dict[int, int] = {}  # choice index -> output tokens so far (for the spans' end)
        self._token_text = token_text
        self._logprobs = logprobs
        self._token_ids = token_ids
        self._as_ids = tokens_as_ids
        self._prompts = prompts  # choice index -> prompt ids, sent with the choice's first chunk
        self._offsets: dict[int, int] = {}
        self._routes = routed_experts

    def update(self, update: ChoiceUpdate) -> bytes:
        """One choice's new text, with logprobs and ids as asked."""
        choice: dict[str, Any] = {
            "index": update.index,
            "text": update.text,
            "logprobs": None,
            "finish_reason": update.finish_reason,
            "stop_reason": None,
        }
        if self._logprobs:
            offset = self._offsets.get(update.index, 0)
            choice["logprobs"], self._offsets[update.index] = completion_logprobs(
                self._token_text, update.token_ids, update.logprobs, update.top_logprobs, offset, self._as_ids
            )
        # As vLLM 0.33 writes chunks (exclude_unset): these keys always, null when not asked for.
        prompt = self._prompts.pop(update.index, None) if self._token_ids else None
        choice["prompt_token_ids"] = list(prompt) if prompt is not None else None
        choice["token_ids"] = update.token_ids if self._token_ids else None
        choice["weight_versions"] = None
        if self._versions:
            produced = self._counts[update.index] = self._counts.get(update.index, 0) + len(update.token_ids)
            if update.version_spans:
                choice["weight_versions"] = weight_version_spans(update.version_spans, produced)
        if self._routes:  # asked for: on every chunk, null until the choice's last (as vLLM's generate API)
            choice["routed_experts"] = npy_base64(update.routes) if update.routes is not None else None
        return self._head + b',"choices":[' + _dumps(choice) + b'],"kv_transfer_params":null}\n\n'

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage frame, with ``choices: []``."""
        return self._head + b',"choices":[],"usage":' + _dumps(usage_body(prompt_tokens, completion_tokens)) + b"}\n\n"

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes:
        """The last write: the usage frame (if asked) and ``[DONE]``."""
        return self.usage(prompt_tokens, completion_tokens) + DONE_FRAME if include_usage else DONE_FRAME

    @staticmethod
    def error(error: GatewayError) -> bytes:
        """An error event in the stream, then ``[DONE]`` as vLLM ends one."""
        return b"data: " + _dumps(error.body()) + b"\n\n" + DONE_FRAME


def completion_logprobs(
    token_text: TokenText,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[tuple[tuple[int, float], ...]] | None,
    offset: int,
    as_ids: bool,
) -> tuple[dict[str, Any], int]:
    """vLLM's ``CompletionLogProbs`` for these tokens, and the text offset after them.

    ``text_offset[i]`` is where token ``i`` starts, counted as vLLM counts it: the running sum of
    the lengths of the ``tokens`` strings before it (so with ``as_ids``, of the ``token_id:N``
    strings). With ``as_ids`` tokens and alternatives are written ``token_id:N``.
    """
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    for i, token in enumerate(token_ids):
        text = f"token_id:{token}" if as_ids else token_text(token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if top_logprobs is not None:
            entry = {(f"token_id:{t}" if as_ids else token_text(t)[0]): lp for t, lp in top_logprobs[i]}
            entry.setdefault(text, logprobs[i])  # vLLM's entry always holds the sampled token
            tops.append(entry)
        else:
            tops.append({text: logprobs[i]})
    body = {"text_offset": offsets, "token_logprobs": list(logprobs), "tokens": tokens, "top_logprobs": tops}
    return body, offset


def text_completion_body(
    batch: Sequence[PreparedCompletion],
    results: Sequence[ChoiceResult],
    *,
    token_text: TokenText,
    tokens_as_ids: bool,
    weight_versions: bool,
) -> dict[str, Any]:
    """A whole non-streamed ``text_completion`` in vLLM's shape (every field, nulls included)."""
    first = batch[0]
    prompt_of = {p.first_index + i: p.prompt_ids for p in batch for i in range(p.n)}
    choices = []
    for result in results:
        choice: dict[str, Any] = {
            "index": result.index,
            "text": "".join(result.text_parts),
            "logprobs": None,
            "finish_reason": result.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if first.logprobs:
            top = result.top_logprobs or None
            choice["logprobs"], _ = completion_logprobs(
                token_text, result.token_ids, result.logprobs, top, 0, tokens_as_ids
            )
        choice["prompt_token_ids"] = list(prompt_of[result.index]) if first.return_token_ids else None
        choice["token_ids"] = result.token_ids if first.return_token_ids else None
        choice["routed_experts"] = npy_base64(result.routes) if result.routes is not None else None
        spans = result.version_spans if weight_versions else None
        choice["weight_versions"] = weight_version_spans(spans, len(result.token_ids)) if spans else None
        choices.append(choice)
    prompt_tokens = sum(len(p.prompt_ids) for p in batch)
    return {
        "id": first.completion_id,
        "object": "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body(prompt_tokens, sum(len(r.token_ids) for r in results)) | {"prompt_tokens_details": None},
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def npy_base64(routes: np.ndarray) -> str:
    """Routes as vLLM sends them: base64 of the ``.npy`` file bytes (``np.save``; the dtype and shape
    are in its header)."""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def weight_version_spans(spans: Sequence[tuple[int, int]], length: int) -> list[dict[str, Any]]:
    """``(version, first index)`` spans as vLLM's ``WeightVersionSpan``s: half-open ``[start, end)``."""
    out = []
    for i, (version, start) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else length
        out.append({"version": str(version), "start": start, "end": end})
    return out


_dumps = orjson.dumps


@dataclass(frozen=True, slots=True)
class TokenInExchange:
    """One admitted token-in request: a prepared completion per prompt, one response id."""

    batch: list[PreparedCompletion]
    request: CompletionRequest
    token_text: TokenText

    @property
    def stream(self) -> bool:
        return self.request.stream

    def start_stream(self) -> StreamStart:
        first, body = self.batch[0], self.request
        encoder = TextChunkEncoder(
            first.completion_id,
            first.created,
            first.model,
            token_text=self.token_text,
            logprobs=first.logprobs,
            token_ids=first.return_token_ids,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            weight_versions=body.return_weight_versions,
            prompts={p.first_index + i: p.prompt_ids for p in self.batch for i in range(p.n)},
            routed_experts=body.return_routed_experts,
        )
        return StreamStart(encoder, None, first.include_usage)

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        body = self.request
        return text_completion_body(
            self.batch,
            results,
            token_text=self.token_text,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            weight_versions=body.return_weight_versions,
        )


class TokenInEdge(EdgeBase):
    """vLLM's ``/v1/completions``: prompt ids in, sampled ids out, placed in sessions by id prefix."""

    path: str = "/v1/completions"
    name: str = "text_completion"
    request: type[BaseModel] = CompletionRequest
    history_field: str | None = "prompt"

    def session_id(self, body: CompletionRequest) -> str | None:
        return body.session_id or None

    async def open(self, body: CompletionRequest, call: Call) -> TokenInExchange:
        self._service.check_model(body.model, body.n, tenant=call.tenant, bound=call.adapter)
        body.check_supported()
        sampling = SamplingRequest(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            top_logprobs=body.logprobs or 0,
            ignore_eos=body.ignore_eos,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
        )
        routes_from, routes_param = body.routes_start()
        request = TokenInRequest(
            model=body.model,
            n=body.n,
            prompts=body.prompts(),
            add_special_tokens=body.add_special_tokens,
            sampling=sampling,
            stops=body.stop_sequences(),
            logprobs=body.logprobs is not None,
            return_token_ids=bool(body.return_token_ids),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            return_routes=body.return_routed_experts,
            routes_from=routes_from,
            routes_param=routes_param,
            history=KeptHistory.of(body),
        )
        batch = await self._service.prepare_tokens(request, **call.placement())
        return TokenInExchange(batch, body, self._service.token_text)
