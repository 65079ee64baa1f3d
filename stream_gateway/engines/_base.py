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

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    import torch
    from pipeline.vision import ProcessedImage, VisionProcessor

    from stream_gateway.constraints import Constraint

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
    constraint: Constraint | None = None  # only for engines with ``constrained_decoding``
    adapter: str | None = None  # the LoRA adapter that serves the request (one of ``Engine.adapters``); None: the base
    # Mixture-of-experts models: the routes wanted are those of positions ``routes_from`` on (an
    # engine that asks a server for them asks for no earlier rows; in-process engines record all).
    routes_from: int = 0


@dataclass(slots=True)
class EngineStep:
    """Tokens sampled since the previous step of one request.

    Not frozen, though nothing changes one once made (``dataclasses.replace`` makes another): one
    is made per token on every engine's path, and a frozen dataclass's ``__init__`` costs four
    times as much (an ``object.__setattr__`` per field; measured on CPython 3.11).

    ``logprobs[i]`` is the log-probability of ``token_ids[i]``. ``top_logprobs[i]``, when asked
    for, holds ``(token_id, logprob)`` pairs, most likely first. ``finish_reason`` is set on the
    last step only: ``"stop"`` for a stop/EOS token, ``"length"`` for ``max_tokens`` or the
    model's context limit.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: FinishReason | None = None
    policy_version: int = 0  # the weights that sampled these tokens (a swap happens between steps)
    # Last step only, from servers that report them afterwards (vLLM's ``weight_versions``): the
    # authoritative ``(version, first output index)`` spans of the whole output.
    version_spans: tuple[tuple[int, int], ...] | None = None
    # Mixture-of-experts models (``stream_gateway.moe``): the experts that routed the positions the
    # model ran over to produce these tokens, ``[positions, layers, top_k]`` (uint8/uint16). The
    # first step holds the prompt's positions, each later one the previous token's: a whole output
    # covers ``prompt + output - 1`` positions. ``None`` for models without experts. Engines whose
    # servers report routes once a request has finished (``.remote``) put them all on the last step.
    routes: np.ndarray | None = None
    # The position of the first row of ``routes`` in the first step that has any (``0``: the
    # prompt's first; remote engines: ``SamplingParams.routes_from`` when the server honoured it).
    routes_start: int = 0
    # Last step only: the prompt tokens the engine reused from its prefix cache for this request
    # (vLLM's ``usage.prompt_tokens_details.cached_tokens``; 0 for an engine that never reuses,
    # the transformers engine). ``None``: the engine does not say.
    cached_prompt_tokens: int | None = None


def merge_steps(steps: Sequence[EngineStep]) -> EngineStep:
    """Consecutive steps of one request, sampled by one policy version, as one step.

    An engine whose consumer fell behind hands over everything that waited at once (one update,
    one frame), instead of one step per token.
    """
    last = steps[-1]
    top = None
    if all(s.top_logprobs is not None for s in steps):
        top = tuple(t for s in steps for t in s.top_logprobs or ())
    routes = None
    with_routes = [s for s in steps if s.routes is not None]
    if with_routes:
        routes = np.concatenate([s.routes for s in with_routes if s.routes is not None])
    return EngineStep(
        tuple(t for s in steps for t in s.token_ids),
        tuple(lp for s in steps for lp in s.logprobs),
        top,
        last.finish_reason,
        last.policy_version,
        last.version_spans,
        routes,
        with_routes[0].routes_start if with_routes else 0,
        last.cached_prompt_tokens,
    )


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """A mixture-of-experts model's routing: MoE ``layers`` each picking ``top_k`` of ``num_experts``."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype[Any]:
        """The narrowest unsigned integer type an expert id fits: uint8 up to 256 experts, else uint16."""
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)


@dataclass(frozen=True, slots=True)
class WeightUpdateReport:
    """What applying new weights cost the requests in flight.

    ``pause_s`` is how long decoding stood still: the in-memory copy of the tensors (``copy_s``)
    plus recomputing the KV cache of the ``in_flight`` requests under the new weights, which keeps
    every later token's logprob equal to a forward pass of the new weights over the whole
    sequence. Reading and checking the tensors happen before the pause.
    """

    policy_version: int
    previous_version: int
    tensors: int
    copy_s: float
    pause_s: float
    in_flight: int


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """An immutable snapshot of an engine's load."""

    active_requests: int
    waiting_requests: int
    total_requests: int
    total_generated_tokens: int
    running: bool = True  # False once the engine has crashed or stopped: /health says 503
    # Faults the engine survived: its loop failed the requests of one batch and went on with a
    # fresh one (a request's own fault fails that request alone and is not counted here).
    recoveries: int = 0
    last_fault: str | None = None


class Upstream(Protocol):
    """One inference server of a remote engine's pool, as the control plane sees it."""

    url: str
    healthy: bool
    outstanding: int


class UpstreamControl(Protocol):
    """The capability of an engine that samples on a pool of servers: change the pool at run time."""

    def upstream_list(self) -> Sequence[Upstream]:
        """The servers of the pool, in order."""
        ...

    def describe_upstreams(self) -> list[dict[str, object]]:
        """The pool as ``GET /admin/upstreams`` shows it."""
        ...

    async def add_upstream(self, url: str) -> tuple[Upstream, bool]:
        """Add (or keep) the server at ``url``; whether it is new."""
        ...

    def remove_upstream(self, url: str) -> Upstream | None:
        """Take the server at ``url`` out of the pool (``None``: it was not in it)."""
        ...


class ReadControl(Protocol):
    """A pushed request's reads of its server (:meth:`PushEngine.push`): paused while its taker is behind."""

    def pause(self) -> None:
        """Stop reading the server for now (TCP holds it back)."""

    def resume(self) -> None:
        """Read again."""


class StepSink(Protocol):
    """What takes a pushed request's steps in the engine's I/O callbacks (:meth:`PushEngine.push`)."""

    def reading(self, reads: ReadControl) -> None:
        """The engine streams a server's answer into this sink now; ``reads`` pauses it."""

    def take(self, steps: list[EngineStep]) -> bool:
        """The steps that arrived together (at least one). ``True``: the sink is done (a step
        finished, or the sink stops the request early, which aborts it). An exception ends the
        request too, and :meth:`PushEngine.push` raises it."""


@runtime_checkable
class PushEngine(Protocol):
    """An engine that can also hand a request's steps to a sink as they arrive, with no task woken
    per step (the remote engines: a server's frames are read in the connection's callbacks)."""

    async def push(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: StepSink,
        *,
        affinity: str | None = None,
    ) -> None:
        """:meth:`Engine.generate`, pushed: returns once ``sink.take`` said it is done (or the
        answer ended), raises what ``generate`` would raise, or what ``sink.take`` raised.
        Cancelling it aborts the request."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What every engine implements. Engines are async context managers: enter starts them."""

    name: str
    model_id: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    policy_version: int
    remote: bool  # the weights live on other servers: updates only announce a version (see .remote)
    constrained_decoding: bool  # follows SamplingParams.constraint (stream_gateway.constraints)

    @property
    def experts(self) -> ExpertShape | None:
        """A mixture of experts whose steps carry routes; ``None``: dense."""
        ...

    @property
    def adapters(self) -> Mapping[str, int]:
        """LoRA adapters served beside the base (docs/adapters.md): name -> its policy version. A
        request's steps carry its adapter's version; the base has ``policy_version``. Empty: none."""
        ...

    # Vision-language models (docs/images.md): the model's own image processor; None: text only.
    vision: VisionProcessor | None

    @property
    def upstreams(self) -> UpstreamControl | None:
        """The pool of servers of an engine that samples on one (see .remote); ``None`` for others."""
        ...

    async def __aenter__(self) -> Engine: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
    ) -> AsyncGenerator[EngineStep, None]:
        """Start sampling; the returned iterator yields steps until one has a finish reason.

        ``images``: a vision-language model's images (only when :attr:`vision` is set), processed,
        in the order their placeholder runs appear in ``prompt_ids``.

        Closing the iterator early aborts the request. ``affinity`` (the session id) is a hint for
        engines that spread requests over several servers: the same key goes to the same server
        while it is healthy, where the conversation's prefix is cached. Others ignore it.
        """
        ...

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """Copy ``tensors`` (all of the model's, or only those that changed) into the model between two
        decode steps and bump :attr:`policy_version`; requests in flight continue on the new weights.

        Raises :class:`WeightsRejected` (nothing changed) for unknown names or wrong shapes.
        """
        ...

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """:meth:`update_weights` with the ``*.safetensors`` files of the directory ``path``."""
        ...

    def statistics(self) -> EngineStatistics: ...
