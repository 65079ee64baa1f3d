"""``RenderPieces``: a render tokenized piece by piece gives the whole render's ids, on the tiny
model's byte-level BPE and on SmolLM2's GGUF-converted tokenizer; a new session's shared system
prompt and tools are tokenized by the first two sessions only (counters); memory stays bounded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion import _context
from stream_gateway.completion._context import ContextBuilder, RenderPieces
from stream_gateway.completion._request import Message, Tool
from stream_gateway.models import smollm2_path

_SYSTEM = "You are a coding agent. " + "".join(
    f"Rule {i}: keep the tests honest and the diffs small.\n" for i in range(60)
)
_TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 10,
                                          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
    )
    for i in range(8)
]  # fmt: skip
_ODD = ["naïve café — 東京 🚀", " spaced  ", "\n\n\n", "tabs\tand\r\nnewlines", "<|im_start|>spelled", "<|im_end", "}"]


def _tokenizer(name: str, tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path if name == "tiny" else smollm2_path())


def _conversation(rng: random.Random) -> list[Message]:
    messages = [Message(role="system", content=_SYSTEM)]
    for i in range(rng.randrange(1, 6)):
        words = " ".join(rng.choice([*_ODD, "word", "the", str(i)]) for _ in range(rng.randrange(0, 30)))
        messages.append(Message(role="user", content=words))
        if rng.random() < 0.7:
            messages.append(Message(role="assistant", content=rng.choice(_ODD) + words[::-1]))
    if messages[-1].role == "assistant":
        messages.append(Message(role="user", content="go on"))
    return messages


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_pieces_from_memory_give_the_whole_renders_ids(name: str, tiny_model_path: Path) -> None:
    tokenizer = _tokenizer(name, tiny_model_path)
    builder = ContextBuilder(tokenizer)
    assert builder._pieces is not None
    rng = random.Random(7)
    for _ in range(40):
        messages = _conversation(rng)
        text = builder._render([m.model_dump(exclude_none=True) for m in messages], None, generation=True)
        whole = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(3):  # first seen, kept on the second sighting, from memory on the third
            assert builder._pieces.encode(text) == whole
        cold = builder.build(messages, _TOOLS, None)
        assert list(cold.prompt_ids) == tokenizer.encode(
            builder._render([m.model_dump(exclude_none=True) for m in messages], _context._tool_specs(_TOOLS),
                            generation=True), add_special_tokens=False)  # fmt: skip


def test_new_sessions_tokenize_their_own_messages_once_the_shared_prefix_is_kept(tiny_model_path: Path) -> None:
    builder = ContextBuilder(_tokenizer("tiny", tiny_model_path))
    chars = []
    for n in range(4):
        question = f"Session {n}: fix the failing test in module_{n}.py, please."
        context = builder.build([Message(role="system", content=_SYSTEM), Message(role="user", content=question)],
                                _TOOLS, None)  # fmt: skip
        assert context.cold
        chars.append(context.tokenized_chars)
    # The first two sessions tokenize the system prompt and the tool schemas (seen once, then kept);
    # from the third on, only the session's own message and the pieces around it are new.
    assert chars[0] > len(_SYSTEM) and chars[1] > len(_SYSTEM)
    assert chars[2] < 200 and chars[3] < 200, chars


def test_kept_pieces_stay_within_their_bound(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_context, "_PIECES_CHARS", 4000)
    tokenizer = _tokenizer("tiny", tiny_model_path)
    pieces = RenderPieces(lambda text: tokenizer.encode(text, add_special_tokens=False), ["<|im_start|>", "<|im_end|>"])
    texts = [f"<|im_start|>user\n{f'message {n} ' * 30}<|im_end|>\n" for n in range(40)]
    for text in texts * 2:  # each piece seen twice: kept, oldest out first
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert pieces._chars <= 4000
    assert sum(len(p) for p in pieces._kept) == pieces._chars
    assert texts[-1].split("<|im_end|>")[0] in pieces._kept
    assert texts[0].split("<|im_end|>")[0] not in pieces._kept


def test_a_tokenizer_not_split_at_special_tokens_tokenizes_whole_renders(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the probe finds a tokenizer that does not tokenize either side of a special token on its
    own, nothing is pieced together (the anchors are off for the same reason)."""
    monkeypatch.setattr(_context, "_splits_at_special_tokens", lambda encode, markers: False)
    builder = ContextBuilder(_tokenizer("tiny", tiny_model_path))
    assert builder._pieces is None
    context = builder.build([Message(role="system", content=_SYSTEM), Message(role="user", content="hi")], None, None)
    assert context.tokenized_chars > len(_SYSTEM)
