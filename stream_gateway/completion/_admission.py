"""Admission: what every request must pass before it reaches the engine, whatever its protocol.

One place decides the model, ``n``, the size bounds, the context length and the sampling defaults,
for chat-shaped requests (chat, Messages, Responses) and token-in ones alike, so that a default
(``--default-temperature``, ``--default-max-tokens``) cannot mean one thing on one route and
another on the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from stream_gateway._errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from stream_gateway._settings import Settings
from stream_gateway.constraints import Constraint
from stream_gateway.engines import Engine, SamplingParams

__all__ = ["Admission", "SamplingRequest"]

_PLAUSIBLE_CHARS_PER_TOKEN = 4  # above this many characters per context token, count before rendering
_PREFIX_CHARS_PER_TOKEN = 16  # ...the tokens of at most this many characters per context token
_CUT_MARGIN = 16


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """The sampling fields of a request, in the core's terms (``None``: the request set none)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    top_logprobs: int
    ignore_eos: bool
    stop_token_ids: frozenset[int] = frozenset()


class Admission:
    """Refuses what cannot be served (with the OpenAI error a client expects) and fills in defaults."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        # The tenant an adapter is bound to (the key file's ``adapter=``; None: anyone may name
        # it). The app sets it to its key ring's.
        self.adapter_owner: Callable[[str], str | None] = lambda adapter: None

    def check_model_and_n(
        self, model: str, n: int, *, tenant: str | None = None, bound: str | None = None
    ) -> str | None:
        """The LoRA adapter that serves the request (``None``: the base model); refuse a request
        for another model, or for an adapter bound to another tenant (404, as any other tenant's
        resource), or for more choices than allowed (400).

        ``bound``: the adapter the tenant's key is bound to, which serves it whatever ``model``
        says (the agent's configuration need not change)."""
        if n > self._settings.max_n:
            raise InvalidRequest(f"n must be at most {self._settings.max_n}", param="n")
        adapters = self._engine.adapters
        if bound is not None:
            if bound not in adapters:
                raise ModelNotFound(
                    f"This key is bound to the adapter `{bound}`, which is not loaded (--lora NAME=DIR).",
                    param="model",
                )
            return bound
        if model == self._engine.model_id:
            return None
        owner = self.adapter_owner(model) if model in adapters else None
        if model not in adapters or (owner is not None and owner != tenant):
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        return model

    def check_message_count(self, count: int) -> None:
        """Refuse more messages than ``--max-messages``."""
        limit = self._settings.max_messages
        if count > limit:
            raise InvalidRequest(f"A request may hold at most {limit} messages (--max-messages).", param="messages")

    def characters_need_counting(self, chars: int) -> int | None:
        """Refuse text that cannot fit whatever its tokens; for suspiciously long text, the budget of
        characters whose tokens to count (:meth:`check_prefix_tokens`); ``None``: nothing to count."""
        context = self._engine.max_model_len
        if chars > context * self._longest_token:
            raise too_long(context, f"{chars} characters, more than {context} tokens can hold")
        if chars > context * _PLAUSIBLE_CHARS_PER_TOKEN:
            return context * _PREFIX_CHARS_PER_TOKEN
        return None

    def check_prefix_tokens(self, texts: list[str], budget: int) -> None:
        """Refuse messages whose first ``budget`` characters already hold more tokens than the
        context (runs the tokenizer: call it off the event loop)."""
        context = self._engine.max_model_len
        encode = self._engine.tokenizer.backend_tokenizer.encode
        tokens = 0
        for text in texts:
            text = text[:budget]
            budget -= len(text)
            # A cut inside a word can split it into more tokens than the whole word takes.
            tokens += len(encode(text, add_special_tokens=False).ids) - (_CUT_MARGIN if budget <= 0 else 0)
            if budget <= 0:
                break
        if tokens > context:
            raise too_long(context, f"more than {context} tokens (over {tokens} in their first part)")

    def fit(self, prompt_tokens: int, requested: int | None, *, noun: str, max_param: str) -> int:
        """The room left for the completion; 400 ``context_length_exceeded`` if the prompt and the
        requested completion do not fit (``noun``: what the prompt is called, and the param blamed
        when nothing is left)."""
        limit = self._engine.max_model_len
        room = limit - prompt_tokens
        if room <= 0 or (requested is not None and requested > room):
            completion = requested if requested is not None else 1
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + completion} tokens ({prompt_tokens} in the {noun}, "
                f"{completion} in the completion). Please reduce the length of the {noun} or completion.",
                param=max_param if room > 0 else noun,
            )
        return room

    def params(
        self, request: SamplingRequest, room: int, constraint: Constraint | None = None, adapter: str | None = None
    ) -> SamplingParams:
        """The engine's sampling parameters: the request's, and the gateway's defaults where it set none."""
        settings = self._settings
        return SamplingParams(
            max_tokens=request.max_tokens if request.max_tokens is not None else min(settings.default_max_tokens, room),
            temperature=settings.default_temperature if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=max(request.top_k or 0, 0),
            seed=request.seed,
            top_logprobs=request.top_logprobs,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            constraint=constraint,
            adapter=adapter,
        )

    @cached_property
    def _longest_token(self) -> int:
        # The most characters one token decodes to: its vocabulary string has one character per
        # byte (byte-level BPE) or per character (SentencePiece), and never fewer. Lazily: the
        # engine's tokenizer exists only once the engine has started.
        return max(len(token) for token in self._engine.tokenizer.get_vocab())


def too_long(context: int, holds: str) -> ContextLengthExceeded:
    """The refusal of messages that cannot fit the context whatever the completion."""
    return ContextLengthExceeded(
        f"This model's maximum context length is {context} tokens. However, your messages hold {holds}. "
        "Please reduce the length of the messages.",
        param="messages",
    )
