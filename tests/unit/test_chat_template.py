"""The gateway's chat-template render (completion/_template.py) equals ``apply_chat_template``'s,
text for text and refusal for refusal, on every built-in model's template and on templates written
to reach the sandbox's edges (loop attributes, ``dict`` method names, undefined keys, dunders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._template import ChatTemplate, _ChatTemplateSandbox, _compiled
from stream_gateway.models._smollm2 import SMOLLM2_CHAT_TEMPLATE
from stream_gateway.models._tiny import TINY_CHAT_TEMPLATE
from stream_gateway.models._tiny_reasoning import TINY_REASONING_CHAT_TEMPLATE
from stream_gateway.models._tiny_vl import TINY_VL_CHAT_TEMPLATE

# Each line reads what the short-cuts touch: a loop's attributes, plain dicts' keys (present,
# missing, named like a dict method), nested dicts, a dict subclass's, and `is defined` on them.
_EDGES = """\
{%- for message in messages -%}
[{{ loop.index0 }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} {{ loop.revindex }} {{ loop.cycle('a', 'b') }}\
 {{ loop.previtem.role if loop.previtem is defined else '-' }} {{ loop.nonexistent is defined }}]
{{ message.role }}: {{ message.content }} {{ message.missing is defined }} {{ message.items is defined }}\
 {{ message.get('name', 'anon') }} {{ message.keys() | list | length }}
{%- for call in message.tool_calls or [] %} {{ call.function.name }}({{ call.function.arguments | tojson }})\
{{ call.function.absent | default('?') }}{% endfor %}
{%- if message.extra is defined %} extra={{ message.extra.inner }} {{ message.extra.pop is defined }}{% endif %}
{% endfor -%}
{{ bos_token if bos_token is defined else '' }}{{ tools | length if tools else 0 }}\
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""

# The sandbox's refusals: each must raise (or render undefined) exactly as it does in transformers.
_REFUSED = [
    "{{ messages[0].__class__.__mro__ }}",
    "{{ messages.__class__ }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages[0].clear() }}",
    "{{ loop }}",
    "{% for m in messages %}{{ loop._after }}{% endfor %}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "{{ raise_exception('no ' + messages[0].role) }}",
    "{{ messages[0].role.format.__globals__ }}",
]


class _Tagged(dict[str, Any]):
    """A dict subclass: not short-cut, the sandbox decides."""


_CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    ([{"role": "user", "content": "hi"}], None, {}),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Read the README."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should read it.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": {"path": "README.md"}}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "The secret word is lighthouse."},
            {"role": "tool", "tool_call_id": "c2", "content": "second result"},
            {"role": "assistant", "content": "It says lighthouse.", "reasoning_content": "Found it."},
            {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "please."}]},
        ],
        [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}],
        {"enable_thinking": False},
    ),
    (
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A square.", "name": "bot", "extra": {"inner": 7}},
            {"role": "user", "content": "And now?", "extra": _Tagged(inner="tagged")},
        ],
        None,
        {"enable_thinking": True},
    ),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _both(tokenizer: PreTrainedTokenizerBase, source: str, messages: Any, tools: Any, kwargs: Any) -> list[Any]:
    """The two renders (each a text or the refusal's type and message), with and without the
    generation prompt."""
    tokenizer.chat_template = source
    ours = ChatTemplate(tokenizer)
    results: list[Any] = []
    for generation in (False, True):
        for render in ("transformers", "ours"):
            try:
                text: Any
                if render == "transformers":
                    text = tokenizer.apply_chat_template(
                        messages, tools=tools, add_generation_prompt=generation, tokenize=False, **kwargs
                    )
                else:
                    text = ours.render(messages, tools, generation, **kwargs)
                results.append(text)
            except (TemplateError, TypeError) as exc:  # TypeError: SmolLM2's template on text parts
                results.append((type(exc).__name__, str(exc)))
    return results


@pytest.mark.parametrize(
    "source",
    [TINY_CHAT_TEMPLATE, TINY_REASONING_CHAT_TEMPLATE, TINY_VL_CHAT_TEMPLATE, SMOLLM2_CHAT_TEMPLATE, _EDGES],
    ids=["tiny", "tiny-reasoning", "tiny-vl", "smollm2", "edges"],
)
@pytest.mark.parametrize("conversation", range(len(_CONVERSATIONS)))
def test_render_equals_transformers(tokenizer: PreTrainedTokenizerBase, source: str, conversation: int) -> None:
    messages, tools, kwargs = _CONVERSATIONS[conversation]
    plain, ours, plain_generation, ours_generation = _both(tokenizer, source, messages, tools, kwargs)
    assert ours == plain
    assert ours_generation == plain_generation
    if isinstance(plain, str):  # a render, and one with the generation prompt
        assert isinstance(ours_generation, str) and ours_generation != ours


def test_edge_template_reads_what_it_should(tokenizer: PreTrainedTokenizerBase) -> None:
    """The edges template's own output: the short-cut reads are the values, not undefined."""
    messages, tools, kwargs = _CONVERSATIONS[2]
    text = _both(tokenizer, _EDGES, messages, tools, kwargs)[1]
    assert "[0/3 True False 3 a - False]" in text
    assert "[1/3 False False 2 b user False]" in text
    assert "user:" in text and "False True anon 2" in text  # missing key undefined, `items` is a method
    assert "assistant: A square. False True bot 4" in text
    # `pop` would modify the dict: the immutable sandbox answers undefined, for a dict and a subclass
    assert "extra=7 False" in text and "extra=tagged False" in text


@pytest.mark.parametrize("source", _REFUSED)
def test_sandbox_refusals_are_unchanged(tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain, ours, *_ = _both(tokenizer, source, messages, None, {})
    assert ours == plain


def test_the_templates_render_in_the_gateways_sandbox() -> None:
    """The short-cuts are in use (not the fallback through apply_chat_template), in an environment
    configured as transformers configures its own."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    for source in (TINY_CHAT_TEMPLATE, SMOLLM2_CHAT_TEMPLATE):
        compiled = _compiled(source)
        assert compiled is not None and type(compiled.environment) is _ChatTemplateSandbox
        theirs = _compile_jinja_template(source).environment
        assert compiled.environment.filters["tojson"] is theirs.filters["tojson"]
        assert compiled.environment.globals["raise_exception"] is theirs.globals["raise_exception"]
        assert (compiled.environment.trim_blocks, compiled.environment.lstrip_blocks) == (True, True)
