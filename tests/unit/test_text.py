"""Incremental detokenization: whole characters only, stop strings never leak, and a byte-level
tokenizer's tokens looked up without changing a piece."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._text import TextAssembler, TokenTexts


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


TEXTS = ["plain ascii words", "café naïve Zürich", "東京 你好，世界", "emoji 😀👍🏽 mixed", "½ ≈ 0.5 → ✓"]  # noqa: RUF001


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_yields_only_whole_characters(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler = TextAssembler(tokenizer.backend_tokenizer)
    pieces = [assembler.feed([token]).text for token in ids]
    assert "".join(pieces) + assembler.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    # Byte-level BPE really does split some of these characters across tokens.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces


def test_special_tokens_are_not_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [*tokenizer.encode("done", add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assembler = TextAssembler(tokenizer.backend_tokenizer)
    assert "".join(assembler.feed([t]).text for t in ids) == "done"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world. bye", ["."], "hello world"),
        ("hello world. bye", ["world"], "hello "),
        ("abcSTOPdef", ["STOP", "cS"], "ab"),
        ("no stop here", ["zzz"], "no stop here"),
        ("almost STO", ["STOP"], "almost STO"),
    ],
)
def test_stop_strings(tokenizer: PreTrainedTokenizerBase, text: str, stops: list[str], expected: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler = TextAssembler(tokenizer.backend_tokenizer, stops)
    out, stopped = [], False
    for token in ids:
        delta = assembler.feed([token])
        out.append(delta.text)
        # Nothing sent so far may contain a stop string or its start at the end.
        assert not any(s in "".join(out) for s in stops)
        if delta.stopped:
            stopped = True
            break
    if not stopped:
        out.append(assembler.flush())
    assert "".join(out) == expected
    assert stopped == (expected != text)


def test_partial_stop_is_held_back_until_resolved(tokenizer: PreTrainedTokenizerBase) -> None:
    assembler = TextAssembler(tokenizer.backend_tokenizer, ["</end>"])
    sent = ""
    for token in tokenizer.encode("value</en", add_special_tokens=False):
        sent += assembler.feed([token]).text
    assert sent == "value"
    for token in tokenizer.encode("d>", add_special_tokens=False):
        delta = assembler.feed([token])
        sent += delta.text
    assert delta.stopped
    assert sent == "value"


def _plain_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    stream = DecodeStream(skip_special_tokens=True)
    return [stream.step(tokenizer.backend_tokenizer, token) or "" for token in ids]


@pytest.mark.parametrize("seed", range(5))
def test_looked_up_texts_give_what_decode_stream_gives_token_by_token(
    tokenizer: PreTrainedTokenizerBase, seed: int
) -> None:
    """The table's shortcut changes no piece: whole texts with split characters and special tokens
    among them, and random ids that make broken UTF-8 (DecodeStream's replacement characters)."""
    backend = tokenizer.backend_tokenizer
    assert TokenTexts.of(backend) is not None  # the tiny model's decoder is byte-level
    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    for text in rng.sample(TEXTS, len(TEXTS)):
        ids += [*tokenizer.encode(text, add_special_tokens=False), end]
    ids += [rng.randrange(backend.get_vocab_size()) for _ in range(3000)]
    ids += tokenizer.encode("😀 after the noise", add_special_tokens=False)
    assembler = TextAssembler(backend)
    assert [assembler.feed([token]).text for token in ids] == _plain_pieces(tokenizer, ids)
    several = TextAssembler(backend)
    assert "".join(several.feed(ids[i : i + 3]).text for i in range(0, len(ids), 3)) == "".join(
        _plain_pieces(tokenizer, ids)
    )


def test_only_a_byte_level_decoder_gets_a_table() -> None:
    """A SentencePiece-style decoder strips the first token's space: a token's text depends on where
    it stands, so every token goes through DecodeStream."""
    vocab = {"▁hello": 0, "▁world": 1, "<unk>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    assert TokenTexts.of(backend) is None
    assembler = TextAssembler(backend)
    assert [assembler.feed([t]).text for t in [0, 1]] == ["hello", " world"]
