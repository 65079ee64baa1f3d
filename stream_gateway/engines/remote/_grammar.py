"""Constrained requests on a server: what it sampled, checked against the request's grammar.

A ``vllm-http`` request with a constraint hands the grammar to the server (its structured
outputs, :mod:`._vllm`), and the server masks its own logits. Whether it followed *this* grammar
is not a given: vLLM's default backend picks xgrammar first, which reads llguidance's ``%json``
rules but not their options, so the JSON it allows has whitespace this grammar forbids (seen
against vLLM 0.32, and recorded would be a turn whose recorded grammar does not replay). So the
engine walks every sampled token through the grammar here too (llguidance's matcher, microseconds
per token, no mask computed), and a token the grammar refuses fails that request alone, naming
the server and what to change there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase

from stream_gateway._errors import SequenceFailed
from stream_gateway.constraints import Constraint, TokenMask, eos_ids, grammar_tokenizer

__all__ = ["GrammarCheck", "end_ids"]

log = logging.getLogger(__name__)


def end_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path) -> frozenset[int]:
    """The tokens a server ends a turn with: the tokenizer's end-of-sequence and the generation
    config's (what vLLM stops on), read from the model directory (the config may be absent)."""
    try:
        configured = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    return eos_ids(tokenizer.eos_token_id, configured)


class GrammarCheck:
    """One request's grammar state, advanced by every token the server sampled."""

    __slots__ = ("_mask", "_taken")

    def __init__(self, constraint: Constraint, tokenizer: PreTrainedTokenizerBase, ends: Iterable[int]) -> None:
        """Build the matcher (blocking: a large grammar takes milliseconds; run it off the loop)."""
        vocab = len(tokenizer)
        self._mask = TokenMask(constraint, grammar_tokenizer(tokenizer, vocab, ends), vocab)
        self._taken = 0

    def take(self, token_ids: Sequence[int], url: str) -> None:
        """Advance by a step's tokens; :class:`SequenceFailed` at the first one the grammar refuses."""
        for token in token_ids:
            try:
                self._mask.advance(token)
            except ValueError as exc:
                raise SequenceFailed(
                    f"The inference server {url} sampled a token that the request's grammar refuses (output "
                    f"token {self._taken}: {exc}). Its structured outputs must follow the grammar as given: start "
                    'vLLM with --structured-outputs-config \'{"backend": "guidance"}\' (its default picks '
                    "xgrammar, which reads the grammar's JSON rules but not their whitespace)."
                ) from exc
            self._taken += 1
