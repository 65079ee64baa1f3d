"""``text_encoder``: the ids ``tokenizer.encode`` gives, on the tiny model's byte-level BPE and on
SmolLM2's GGUF-converted tokenizer, and ``encode`` itself wherever the backend is set up otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._context import text_encoder
from stream_gateway.models import smollm2_path

_TEXTS = [
    "",
    "Tell story 3 about a lighthouse keeper.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n",
    "naïve café — 東京 🚀 \x00 tabs\tand\r\nnewlines",
    "<|im_start|" + "broken marker <|im_end|x " * 20,
    " leading and trailing spaces  ",
]


def _tokenizer(name: str, tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path if name == "tiny" else smollm2_path())


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
@pytest.mark.parametrize("special", [False, True])
def test_the_ids_are_encodes_ids(name: str, special: bool, tiny_model_path: Path) -> None:
    tokenizer = _tokenizer(name, tiny_model_path)
    encode = text_encoder(tokenizer)
    for text in _TEXTS:
        assert encode(text, special) == tokenizer.encode(text, add_special_tokens=special), text


def test_a_backend_left_truncating_is_not_trusted(tiny_model_path: Path) -> None:
    # Something else in the process asked the tokenizer to truncate, and left it so on the backend:
    # the prompt must still be whole, as ``encode`` (which resets it) would give it.
    tokenizer = _tokenizer("tiny", tiny_model_path)
    encode = text_encoder(tokenizer)
    text = "one two three four five six seven eight nine ten"
    whole = tokenizer.encode(text, add_special_tokens=False)
    tokenizer.backend_tokenizer.enable_truncation(3)
    assert encode(text, False) == whole
    assert len(whole) > 3


def test_split_special_tokens_goes_through_encode(tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, split_special_tokens=True)
    encode = text_encoder(tokenizer)
    text = "<|im_start|>assistant\n"
    assert encode(text, False) == tokenizer.encode(text, add_special_tokens=False)
    assert len(encode(text, False)) > len(text_encoder(_tokenizer("tiny", tiny_model_path))(text, False))
