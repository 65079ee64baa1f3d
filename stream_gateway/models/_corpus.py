"""What the local models share: ChatML's tokens, the chat checkpoint, synthetic text.

``tiny`` and ``smollm2`` are saved by the same ``_save_chat_checkpoint`` (ChatML stop tokens);
``tiny``'s tokenizer and tiny-agent's corpus are drawn from the same synthetic text. The text
makers draw only from the ``random.Random`` they are given, so a corpus is fixed by its seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ENDOFTEXT", "IM_END", "IM_START", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN"]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def _save_chat_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save with ChatML stop tokens: a turn ends at ``<|im_end|>``, raw text at ``<|endoftext|>``."""
    from transformers import GenerationConfig

    eos, pad = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    tokenizer.eos_token, tokenizer.pad_token = IM_END, ENDOFTEXT
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    # A fresh config rather than the one derived from model.config, which carries copied
    # defaults and a `_from_model_config` flag that older transformers used to override eos.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=model.config.bos_token_id, eos_token_id=[eos, pad], pad_token_id=pad
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise RuntimeError(f"{token!r} is not a single token of this tokenizer")
    return token_id


_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were been has had did said made went found told asked called used
data file code test error value list table user model server request response token stream message tool
result query answer question problem system process thread task queue buffer cache memory disk network
function method class object string number integer float boolean array field record event log metric
weather city country river mountain ocean forest garden kitchen market school office station airport
morning evening night week month today tomorrow yesterday always never often sometimes usually soon
happy small large quick slow bright dark early late simple clear ready open closed free busy careful
please thanks sorry hello welcome great sure maybe certainly exactly probably quickly carefully really
write read send check find search build run start stop open close create delete update install compute
explain summarize translate compare schedule book order cancel confirm remember forget learn teach help
price cost total amount budget invoice payment account balance report summary chart review plan goal
music movie book story song picture photo video game sport team player match score win lose travel trip
"""
_CITIES = ["Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Madrid", "Seoul", "Cairo", "Toronto"]
_UNICODE = ["café", "naïve", "Zürich", "São Paulo", "東京", "你好\uff0c世界", "Привет", "😀 👍", "½ ≈ 0.5", "→ ✓"]
_WORD_LIST = _WORDS.split()


def _sentence(rng: random.Random, low: int = 5, high: int = 14) -> str:
    words = rng.choices(_WORD_LIST, k=rng.randint(low, high))
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])


def _identifier(rng: random.Random) -> str:
    parts = rng.choices(_WORD_LIST, k=rng.randint(1, 3))
    return rng.choice(["_".join(parts), "".join(w.capitalize() for w in parts)])


def _chat_text(rng: random.Random) -> str:
    user = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
    reply = " ".join(_sentence(rng) for _ in range(rng.randint(2, 5)))
    return (
        f"{IM_START}user\n{user} {rng.choice(_CITIES)} {rng.choice(_UNICODE)}{IM_END}\n"
        f"{IM_START}assistant\n{reply}{IM_END}\n"
    )


def _code_text(rng: random.Random) -> str:
    fn, arg, var = _identifier(rng), _identifier(rng).lower(), _identifier(rng).lower()
    numbers = ", ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(2, 6)))
    return (
        f'```python\ndef {fn}({arg}: list[int]) -> dict[str, int]:\n    """{_sentence(rng)}"""\n'
        f"    {var} = {{}}\n    for i, x in enumerate({arg}):\n        if x > {rng.randint(1, 99)}:\n"
        f"            {var}[str(i)] = x * i\n    return {var}\n\n\nprint({fn}([{numbers}]))\n```\n"
    )


def _tool_text(rng: random.Random) -> str:
    name = "_".join(rng.choices(_WORD_LIST, k=2))
    keys = rng.sample(_WORD_LIST, k=rng.randint(1, 3))
    arguments = {k: rng.choice([rng.choice(_CITIES), rng.randint(0, 100), rng.random() < 0.5]) for k in keys}
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    result = json.dumps({"status": "ok", "result": _sentence(rng, 3, 8)})
    parameters = {"type": "object", "properties": {k: {"type": "string"} for k in keys}}
    function = {"name": name, "description": _sentence(rng, 3, 8), "parameters": parameters}
    schema = {"type": "function", "function": function}
    return (
        f"{json.dumps(schema)}\n{IM_START}assistant\n{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}{IM_END}\n"
        f"{IM_START}user\n<tool_response>\n{result}\n</tool_response>{IM_END}\n"
    )


def _number_text(rng: random.Random) -> str:
    return (
        f"On {rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} the total was "
        f"{rng.randint(0, 10**6)} ({rng.uniform(0, 100):.2f}%), id={rng.getrandbits(32):08x}, "
        f"step {rng.randint(1, 500)}/{rng.randint(500, 1000)} loss={rng.random():.4f}\n"
    )
