"""Constrained decoding: structured outputs and forced tool calls, with llguidance grammars.

A :class:`Constraint` is what a request asks for, as an llguidance grammar:

* ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": ...}}``: the content is
  JSON valid against the schema; ``{"type": "json_object"}``: any JSON object;
* ``tool_choice`` ``"required"``: one or more tool calls in the served model's tool-call format
  (Hermes/Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), each naming
  one of the request's tools with arguments valid against its ``parameters``; a named function:
  exactly one call of it; ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``
  (OpenAI's, sent by openai 3.57): calls of the listed tools only, one or more (``required``) or
  either those or a text answer (``auto``; the text cannot hold a call when the model's call tags
  are tokens of their own, as Qwen's and tiny-agent's are). All the request's tools stay in the
  prompt, as OpenAI keeps them, so a prompt cache still holds.

On a thinking model (``stream_gateway.reasoning``) the constraint holds the answer, not the
thinking: :meth:`Constraint.after_thinking` puts the thinking block in front of it, free text
between the model's own tags (mandatory when the prompt already opened the block, optional
otherwise), as vLLM applies structured outputs only after ``</think>``. The thinking is masked
only as far as a block's text allows (no special token but the closing tag), so its recorded
logprobs replay with the same grammar as the answer's.

Objects hold their declared properties only: an object schema with ``properties`` and no
``additionalProperties`` of its own gets ``additionalProperties: false`` (:func:`_closed`), as
OpenAI's strict mode and xgrammar's (vLLM's default backend) read schemas; JSON Schema's own
default lets a model add keys without end (a tiny model forced into one call wrote ``{"city": ...,
"population": 9, ": ": -8.4e-8, ...}`` until ``max_tokens``). A schema that allows more says so; a
function without ``parameters`` takes none (``{}``), as OpenAI reads it.

JSON is written with fixed separators (``", "``, ``": "``) and no other whitespace: a model free
to choose its whitespace inside a grammar can pad forever, and these are the separators of
``json.dumps`` that models were trained on. The grammar ends where the JSON (or the last call)
ends; after it only the engine's end-of-turn tokens are allowed.

An engine that follows constraints (``Engine.constrained_decoding``) builds one
:class:`TokenMask` per choice and, at every step, sets the logits of tokens the grammar does not
allow to ``-inf`` before temperature, top-k and top-p. The recorded logprobs are those of the
distribution the token was drawn from, the mask included: for constrained tokens they are *not*
what a plain forward pass gives. A trainer that recomputes logprobs replays the mask:
:func:`replay_masks` gives, for each output position, the tokens the grammar allowed there (the
grammar is recorded in the turn's ``sampling.grammar``); ``docs/http-api.md`` says more.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import orjson

from stream_gateway._errors import InvalidRequest

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Constraint",
    "TokenMask",
    "eos_ids",
    "grammar_tokenizer",
    "replay_masks",
    "response_format_constraint",
    "tool_choice_constraint",
]

ConstraintKind = Literal["json_schema", "json_object", "tool_call"]

# JSON as json.dumps writes it; "lenient": schema keywords llguidance cannot enforce (formats...)
# are ignored rather than refused, as OpenAI's non-strict schemas are hints too.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
# Tool-call formats by tool parser: the tags around each call's JSON.
_CALL_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen": ("<tool_call>", "</tool_call>")}


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint: its kind and llguidance grammar (serialized, as recorded).

    ``answer`` is the grammar as lark rules whose start symbol is ``answer`` (what
    :meth:`after_thinking` builds on); ``lark`` the whole grammar in llguidance's lark, as a
    remote server's structured outputs take it (vLLM's ``structured_outputs.grammar``).
    """

    kind: ConstraintKind
    grammar: str
    answer: str
    lark: str = ""

    @classmethod
    def of(cls, kind: ConstraintKind, answer: str) -> Constraint:
        """The constraint whose output is exactly ``answer``'s rules."""
        from llguidance import LLMatcher

        lark = "start: answer\n" + answer
        return cls(kind, LLMatcher.grammar_from_lark(lark), answer, lark)

    def after_thinking(self, start_id: int, end_id: int, *, opened: bool) -> Constraint:
        """This constraint behind a thinking block: the block's text is free, its closing tag
        ends it (at most two newlines follow, as Qwen3's template renders), then the answer.
        ``opened``: the prompt already opened the block (DeepSeek-R1's template), so the output
        starts inside it; otherwise the block is optional and starts with its opening tag."""
        from llguidance import LLMatcher

        close = f"/(.|\\n)*/ <[{end_id}]> /\\n{{0,2}}/"
        think = close if opened else f"(<[{start_id}]> {close})?"
        lark = f"start: {think} answer\n" + self.answer
        return replace(self, grammar=LLMatcher.grammar_from_lark(lark), lark=lark)


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """The constraint ``response_format`` asks for (``None`` for text); 400 for a malformed one."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.of("json_object", _json_rule({"type": "object"}))
    if kind != "json_schema":
        raise InvalidRequest(
            f"Invalid value for 'response_format.type': {kind!r}; expected 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    spec = (response_format or {}).get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequest(
            "response_format json_schema needs a 'json_schema' object with a 'name'", param="response_format"
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "'response_format.json_schema.schema' must be a JSON schema object", param="response_format"
        )
    return Constraint.of("json_schema", _json_rule(_closed(schema)))


_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that declares
    ``properties`` and says nothing of others (a copy; the request's schema is left as sent)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_rule(schema: dict[str, Any]) -> str:
    """The lark rule ``answer``: JSON valid against ``schema``, written as json.dumps writes it."""
    return f"answer: %json {orjson.dumps({**schema, 'x-guidance': _JSON_OPTIONS}).decode()}\n"


def tool_choice_constraint(
    tool_choice: str | dict[str, Any] | None,
    tools: Sequence[Any] | None,
    tokenizer: PreTrainedTokenizerBase,
    tool_parser: str,
    *,
    parallel: bool = True,
) -> Constraint | None:
    """The constraint ``tool_choice`` asks for: ``"required"`` or a named function; else ``None``.

    ``parallel``: ``parallel_tool_calls`` (false: at most one call, as OpenAI defines it; Anthropic's
    ``disable_parallel_tool_use`` arrives as that too)."""
    if tool_choice is None or tool_choice in ("auto", "none") or not tools:
        return None
    by_name = {tool.function.name: tool.function for tool in tools}
    free = False  # a text answer is allowed beside the calls (allowed_tools, mode auto)
    if tool_choice == "required":
        chosen = list(by_name.values())
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        mode, names = _allowed_tools(tool_choice.get("allowed_tools"), by_name)
        chosen, free = [by_name[name] for name in names], mode == "auto"
    else:
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):  # type: ignore[union-attr]
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} "
                "or {'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' | 'required', 'tools': [...]}}",
                param="tool_choice",
            )
        if name not in by_name:
            raise InvalidRequest(f"tool_choice names `{name}`, which is not among the tools", param="tool_choice")
        chosen = [by_name[name]]
    if tool_parser not in _CALL_TAGS:
        raise InvalidRequest(
            f"tool_choice cannot be enforced with the {tool_parser!r} tool parser", param="tool_choice"
        )
    start, end = (_tag(tokenizer, tag) for tag in _CALL_TAGS[tool_parser])
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": _closed(f.parameters or _NO_PARAMETERS)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = (
        {"anyOf": calls, "x-guidance": _JSON_OPTIONS} if len(calls) > 1 else {**calls[0], "x-guidance": _JSON_OPTIONS}
    )
    call = f'{start} "\\n" %json {orjson.dumps(schema).decode()} "\\n" {end}'
    many = parallel and (
        tool_choice == "required" or (isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools")
    )
    calls_rule = 'call ("\\n" call)*' if many else "call"
    rules = f"answer: {calls_rule}\n"
    if free:
        rules = f"answer: {calls_rule} | text\ntext: /(?s:.*)/\n"
    return Constraint.of("tool_call", rules + "call: " + call + "\n")


def _allowed_tools(allowed: object, by_name: dict[str, Any]) -> tuple[str, list[str]]:
    """``allowed_tools``' mode and the names it allows, each one of the request's tools (else a 400)."""
    param = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
        raise InvalidRequest("tool_choice.allowed_tools needs mode 'auto' or 'required' and tools", param=param)
    entries = allowed.get("tools")
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest("tool_choice.allowed_tools.tools must list at least one tool", param=param)
    names = []
    for entry in entries:
        function = entry.get("function") if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                "tool_choice.allowed_tools.tools entries are {'type': 'function', 'function': {'name': ...}}",
                param=param,
            )
        if name not in by_name:
            raise InvalidRequest(f"tool_choice.allowed_tools names `{name}`, which is not among the tools", param=param)
        names.append(name)
    return str(allowed["mode"]), names


def _tag(tokenizer: PreTrainedTokenizerBase, tag: str) -> str:
    """A tag as a lark terminal: its token when the tokenizer has one for it (llguidance sees
    added tokens only by id), else its text."""
    token = tokenizer.convert_tokens_to_ids(tag)
    if isinstance(token, int) and token != tokenizer.unk_token_id and tag in tokenizer.get_added_vocab():
        return f"<[{token}]>"
    return orjson.dumps(tag).decode()


# -- matching -------------------------------------------------------------------------------------

_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()


def eos_ids(*sources: int | Sequence[int] | None) -> frozenset[int]:
    """The end-of-turn ids named by ``sources`` (configs give one id, a list, or none): what a
    grammar of this module allows at its end."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def grammar_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's view of ``tokenizer``, with each token's bytes as the tokenizer decodes it
    (built once; ~20 ms for a 2k vocabulary, ~1 s for 150k).

    llguidance reads a tokenizer's byte mapping from its decoder's declared type. A tokenizer
    converted from GGUF (the default model, SmolLM2) declares a decoder sequence that starts
    with ``ByteFallback`` although its vocabulary is byte-level, so llguidance took ``Ċ`` for
    the two bytes ``c4 8a`` instead of a newline, and the first newline or space a grammar
    forced failed the request (issue 43). :func:`token_bytes` finds the mapping that reproduces
    the tokenizer's own encoding of a probe text; where llguidance's bytes differ from it, the
    vocabulary is handed to llguidance as bytes.
    """
    import llguidance.hf

    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), vocab_size, eos)
    with _tokenizers_lock:
        if key not in _tokenizers:  # the tokenizer is kept alive with it, so its id stays unique
            default = llguidance.hf.from_tokenizer(cast(Any, tokenizer), n_vocab=vocab_size, eos_token=list(eos))
            _tokenizers[key] = (tokenizer, _agreeing(default, tokenizer, vocab_size, eos))
        return _tokenizers[key][1]


def _agreeing(
    default: LLTokenizer, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: tuple[int, ...]
) -> LLTokenizer:
    """``default`` if its bytes are the tokenizer's; else one built from the tokenizer's bytes."""
    from llguidance import LLTokenizer, TokenizerWrapper

    special = frozenset(i for i in range(vocab_size) if default.is_special_token(i))
    table = token_bytes(tokenizer, vocab_size, special)
    if table is None or all(default.decode_bytes([i]) == table[i] for i in range(vocab_size) if i not in special):
        return default
    vocabulary = _Vocabulary(tokenizer, table, sorted(special), eos[0] if eos else default.eos_token)
    return LLTokenizer(TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=list(eos) or None)


class _Vocabulary:
    """A tokenizer as llguidance's ``TokenizerWrapper`` takes one: token bytes and an encoder."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tokens: list[bytes], special: list[int], eos: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance probes for bytes; it then sends text
        return list(self._tokenizer.encode(text, add_special_tokens=False))


_PROBE = 'Hello,\n  world: {"a": [1, 2.5]}\t\u00c4\u20ac \u65e5\u672c <x>'


@cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte -> the byte
    (transformers' own table, as ``completion/_service.py`` reads token bytes)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]


def _byte_level(piece: str) -> bytes:
    table = _byte_level_table()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:
        return piece.encode()


def _sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int, special: frozenset[int]) -> list[bytes] | None:
    """Each token's bytes (special ones as ``0xff`` and their text, llguidance's convention), by the
    mapping (byte-level BPE, SentencePiece, plain text) under which the tokenizer's own pieces of
    a probe text spell that text; ``None`` when none does."""
    probe = _PROBE.encode()
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(_PROBE, add_special_tokens=False))
    for decode in (_byte_level, _sentencepiece, str.encode):
        spelled = b"".join(decode(str(p)) for p in pieces)
        if spelled in (probe, b" " + probe):  # SentencePiece may add a prefix space
            break
    else:
        return None
    added = set(tokenizer.added_tokens_decoder)
    known = min(vocab_size, len(tokenizer))  # len() of a fast tokenizer is not cheap: asked once
    table: list[bytes] = []
    for i, piece in enumerate([*tokenizer.convert_ids_to_tokens(list(range(known))), *[None] * (vocab_size - known)]):
        if piece is None:
            table.append(b"")
        elif i in special:
            table.append(b"\xff" + str(piece).encode())
        else:
            table.append(str(piece).encode() if i in added else decode(str(piece)))
    return table


def check(constraint: Constraint, tokenizer: PreTrainedTokenizerBase, param: str) -> None:
    """400 if llguidance cannot build a matcher for the grammar (an unsupported schema...)."""
    from llguidance import LLMatcher

    lltok = grammar_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id or 0])
    is_error, messages = LLMatcher.validate_grammar_with_warnings(constraint.grammar, lltok)
    if is_error:
        raise InvalidRequest(f"The {param} cannot be enforced: {'; '.join(messages)[:500]}", param=param)


class TokenMask:
    """One choice's grammar state: the tokens allowed next, and the tokens taken."""

    __slots__ = ("_matcher", "_vocab")

    def __init__(self, constraint: Constraint, tokenizer: LLTokenizer, vocab_size: int) -> None:
        from llguidance import LLMatcher

        self._matcher: LLMatcher = LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self._vocab = vocab_size
        if self._matcher.is_error():
            raise ValueError(f"grammar rejected: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: which tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if len(bits) < self._vocab:
            bits = np.pad(bits, (0, self._vocab - len(bits)))
        return bits[: self._vocab].astype(bool)

    def advance(self, token: int) -> None:
        """Take ``token`` (one the mask allowed); raises if the grammar refuses it."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} does not satisfy the grammar: {self._matcher.get_error()}")


def replay_masks(
    grammar: str, tokenizer: PreTrainedTokenizerBase, output_ids: Sequence[int], eos_ids: Iterable[int], vocab_size: int
) -> list[np.ndarray]:
    """For each output position, the tokens the grammar allowed there (what the engine masked).

    A trainer recomputing a constrained turn's logprobs sets the logits of disallowed tokens to
    ``-inf`` at each position before its log-softmax, as the engine did before sampling.
    """
    lltok = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
    mask = TokenMask(Constraint("json_schema", grammar, ""), lltok, vocab_size)
    masks = []
    for token in output_ids:
        masks.append(mask.allowed())
        if not masks[-1][token]:
            raise ValueError(f"token {token} was not allowed by the grammar at position {len(masks) - 1}")
        mask.advance(token)
    return masks
