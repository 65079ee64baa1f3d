"""The ``synthetic`` engine: no model, tokens at a configurable rate, for load tests and benchmarks.

It uses a real tokenizer (so prompts are rendered and counted as for a real model) and emits a
fixed passage's token ids in a loop, with made-up but deterministic logprobs. With a thinking
model's tokenizer (one whose reasoning format ``--reasoning-parser auto`` finds, such as
``tiny-reasoning``'s) the first half of every output is a thinking block, ``<think>`` to
``</think>``, so load tests measure the gateway's split of thinking from answer too. Nothing it
produces is fit for training; it exists to measure the gateway and the event pipeline alone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway._errors import EngineError
from stream_gateway.engines._base import (
    EngineStatistics,
    EngineStep,
    ExpertShape,
    FinishReason,
    SamplingParams,
    UpstreamControl,
    WeightUpdateReport,
)
from stream_gateway.engines._weights import read_checkpoint
from stream_gateway.reasoning import resolve_reasoning_format

if TYPE_CHECKING:
    import torch

    from stream_gateway._settings import Settings

__all__ = ["SyntheticEngine", "create_engine", "engine_options"]

_PASSAGE = (
    "Streaming lets an agent act on the first tokens while the rest are still being sampled. "
    "Every token here is recorded with its id and log-probability, so the traffic can be trained on. "
)


class SyntheticEngine:
    """Emits tokens of a fixed passage at ``tokens_per_second`` per request (0: unthrottled)."""

    name = "synthetic"
    remote = False
    constrained_decoding = False
    experts: ExpertShape | None = None
    vision: VisionProcessor | None = None  # text only (docs/images.md)
    adapters: Mapping[str, int] = MappingProxyType({})  # no LoRA on this engine
    upstreams: UpstreamControl | None = None

    def __init__(
        self,
        tokenizer: str | Path,
        *,
        served_model_name: str = "synthetic",
        tokens_per_second: float = 0.0,
        max_model_len: int = 32768,
    ) -> None:
        self._tokenizer_path = str(tokenizer)
        self.model_id = served_model_name
        self.max_model_len = max_model_len
        self.policy_version = 0
        self._interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.tokenizer: PreTrainedTokenizerBase
        self._passage: list[int] = []
        self._thinking: tuple[int, int] | None = None  # the tags' ids, when the tokenizer's model thinks
        self._active = 0
        self._total_requests = 0
        self._total_tokens = 0

    async def __aenter__(self) -> SyntheticEngine:
        self.tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, self._tokenizer_path)
        self._passage = self.tokenizer.encode(_PASSAGE, add_special_tokens=False)
        fmt = resolve_reasoning_format("auto", self.tokenizer)
        self._thinking = (fmt.start_id, fmt.end_id) if fmt is not None and fmt.name == "qwen3" else None
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
    ) -> AsyncGenerator[EngineStep, None]:
        """Yield ``max_tokens`` passage tokens (fewer if the context fills up or a stop id comes up),
        one per step; a thinking model's first half of them between its thinking tags."""
        if images:  # the preparer refuses them first (vision is None): never sample without them
            raise EngineError(f"the {self.name} engine does not take images")
        self._active += 1
        self._total_requests += 1
        try:
            budget = min(params.max_tokens, self.max_model_len - len(prompt_ids))
            offset = len(prompt_ids) % len(self._passage)
            tags = {0: self._thinking[0], max(budget // 2, 1): self._thinking[1]} if self._thinking else {}
            stops = params.stop_token_ids
            for i in range(budget):
                token = tags.get(i) or self._passage[(offset + i) % len(self._passage)]
                stopped = token in stops
                last = stopped or i == budget - 1
                top = ((token, -0.25),) * min(params.top_logprobs, 1) if params.top_logprobs else None
                self._total_tokens += 1
                if self._interval:
                    await anyio.sleep(self._interval)
                else:
                    # Yield to the loop as a real engine would, so other streams interleave.
                    await anyio.lowlevel.checkpoint()
                reason: FinishReason | None = ("stop" if stopped else "length") if last else None
                yield EngineStep((token,), (-0.25,), (top,) if top else None, reason, self.policy_version)
                if last:
                    return
        finally:
            self._active -= 1

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """There are no weights to copy: any tensors are accepted and only the policy version moves."""
        started = time.perf_counter()
        previous, self.policy_version = self.policy_version, policy_version
        pause = time.perf_counter() - started
        return WeightUpdateReport(policy_version, previous, len(tensors), pause, pause, self._active)

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """Read the checkpoint (so an unreadable one is refused as by a real engine), then bump the version."""
        tensors = await anyio.to_thread.run_sync(read_checkpoint, path)
        return await self.update_weights(tensors, policy_version)

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's load."""
        return EngineStatistics(self._active, 0, self._total_requests, self._total_tokens)


def engine_options(name: str, settings: Settings) -> dict[str, Any]:
    """The engine's constructor arguments from a process's settings (see :mod:`.registry`)."""
    options: dict[str, Any] = {
        "served_model_name": settings.served_model_name or "synthetic",
        "tokens_per_second": settings.synthetic_tokens_per_second,
    }
    if settings.max_model_len:
        options["max_model_len"] = settings.max_model_len
    return options


def create_engine(name: str, model: str | Path, **options: Any) -> SyntheticEngine:
    """A :class:`SyntheticEngine` with ``model``'s tokenizer (see :mod:`.registry`)."""
    return SyntheticEngine(model, **options)
