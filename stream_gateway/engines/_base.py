"""The engine protocol: what the gateway needs from anything that samples tokens.

An engine takes prompt token ids and sampling parameters and yields :class:`EngineStep` objects
as tokens are sampled. Closing the iterator (``aclose()``, or cancelling the task consuming it)
aborts the request inside the engine: that is how a client that disconnects stops generation.

The gateway never re-tokenizes sampled text: every step carries the sampled ids themselves and
the log-probabilities of exactly those ids under the distribution they were drawn from
("processed" logprobs: after temperature and top-k/top-p filtering; for greedy decoding the raw
model distribution). That is what RL training needs to compute importance ratios.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling parameters, already validated by the HTTP layer.

    ``temperature == 0`` means greedy decoding. ``top_logprobs`` is the number of alternatives to
    return per position (0 for none); ``logprobs`` of the sampled ids are always computed because
    capture needs them. ``stop_token_ids`` end the generation and are part of the sampled ids.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class EngineStep:
    """Tokens sampled since the previous step of one request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]``. ``top_logprobs[i]``, when asked
    for, holds ``(token_id, logprob)`` pairs, most likely first. ``finish_reason`` is set on the
    last step only: ``"stop"`` for a stop/EOS token, ``"length"`` for ``max_tokens`` or the
    model's context limit.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """An immutable snapshot of an engine's load."""

    active_requests: int
    waiting_requests: int
    total_requests: int
    total_generated_tokens: int
    running: bool = True  # False once the engine has crashed or stopped: /health says 503


@runtime_checkable
class Engine(Protocol):
    """What every engine implements. Engines are async context managers: enter starts them."""

    name: str
    model_id: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    policy_version: int

    async def __aenter__(self) -> Engine: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncGenerator[EngineStep, None]:
        """Start sampling; the returned iterator yields steps until one has a finish reason.

        Closing the iterator early aborts the request.
        """
        ...

    async def load_weights(self, path: str, policy_version: int) -> None:
        """Replace the model's weights and bump :attr:`policy_version` between requests' steps."""
        ...

    def statistics(self) -> EngineStatistics: ...
