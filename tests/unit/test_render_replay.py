"""The recorded chat-template render (completion/_replay.py): replaying the previous render of a
shorter conversation gives exactly the text of a plain render, on every built-in model's template
and on templates written to defeat a replay (length reads, shared state, buffered loops, clocks);
and it runs the template only for what the conversation added where the template allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._template import ChatTemplate
from stream_gateway.models._smollm2 import SMOLLM2_CHAT_TEMPLATE
from stream_gateway.models._tiny import TINY_CHAT_TEMPLATE
from stream_gateway.models._tiny_reasoning import TINY_REASONING_CHAT_TEMPLATE
from stream_gateway.models._tiny_vl import TINY_VL_CHAT_TEMPLATE

_LOOP = "{%- for message in messages %}<{{ message.role }}>{{ message.content }}</{{ message.role }}>\n"
_END = "{%- endfor %}{%- if add_generation_prompt %}<assistant>{% endif %}"

# Each would give a wrong text if its iterations were pasted from the shorter conversation's render.
_TRAPS = {
    "loop.last": _LOOP + "{% if loop.last %}(last){% endif %}" + _END,
    "loop.length": _LOOP + "{{ loop.index }}/{{ loop.length }}" + _END,
    "loop.revindex": _LOOP + "{{ loop.revindex0 }}" + _END,
    "loop.nextitem": _LOOP + "{{ loop.nextitem.role if loop.nextitem is defined else 'end' }}" + _END,
    "messages[-1] before the loop": "{% set final = messages[-1].content %}" + _LOOP + "{{ final }}" + _END,
    "length before the loop": "{% set n = messages | length %}" + _LOOP + "{{ n }}" + _END,
    "length in the loop": _LOOP + "{{ messages | length }}" + _END,
    "last filter": _LOOP + "{{ (messages | last).content }}" + _END,
    "namespace across iterations": "{% set ns = namespace(count=0) %}"
    + _LOOP
    + "{% set ns.count = ns.count + 1 %}{{ ns.count }}"
    + _END,
    "namespace from a reversed pass": "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages[::-1] %}{% if ns.last_user < 0 and m.role == 'user' %}"
    "{% set ns.last_user = messages | length - 1 - loop.index0 %}{% endif %}{% endfor %}"
    + _LOOP
    + "{{ 'after' if loop.index0 > ns.last_user else 'before' }}"
    + _END,
    "loop.changed": _LOOP + "{{ loop.changed(message.role) }}" + _END,
    "nested loop over messages": _LOOP + "{% for other in messages %}.{% endfor %}" + _END,
    "reversed iteration": _LOOP + "{{ (messages | reverse | list)[0].content }}" + _END,
    "messages as JSON": _LOOP + _END + "{{ messages | tojson }}",
    "loop in a macro": "{% macro all(ms) %}{% for message in ms %}[{{ loop.index }}/{{ loop.length }}"
    "{{ message.content }}]{% endfor %}{% endmacro %}{{ all(messages) }}",
    "loop in a set block": "{% set body %}" + _LOOP + "{{ loop.index }}{% endfor %}{% endset %}{{ body }}{{ 1 }}",
    "loop in a filter block": "{% filter upper %}" + _LOOP + "{{ loop.index }}{% endfor %}{% endfilter %}",
    "the date": "{{ strftime_now('%Y') }}" + _LOOP + "{{ strftime_now('%d') }}" + _END,
}

# Templates a replay must serve, with how many iterations a turn may run (the tail it adds and the
# old last message, which reads the next position through loop.last or a neighbour lookup).
_REPLAYED = {
    "tiny": TINY_CHAT_TEMPLATE,
    "smollm2": SMOLLM2_CHAT_TEMPLATE,
    "tiny-vl": TINY_VL_CHAT_TEMPLATE,
    "slice without the system message (Llama-style)": "{% if messages[0].role == 'system' %}"
    "{% set system = messages[0].content %}{% set rest = messages[1:] %}{% else %}{% set system = '' %}"
    "{% set rest = messages %}{% endif %}[{{ system }}]"
    + _LOOP.replace("in messages", "in rest")
    + "{% if loop.first %}(first){% endif %}{% if loop.index0 % 2 == 0 %}even{% endif %}"
    + _END,
    "neighbour lookups": _LOOP
    + "{% if loop.index0 > 0 and messages[loop.index0 - 1].role == message.role %}(again){% endif %}"
    + "{{ loop.previtem.role if loop.previtem is defined else '' }}"
    + _END,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _turn(i: int) -> list[dict[str, Any]]:
    """What one agent turn appends: an answer (every third a tool call) and a user message or tool results."""
    if i % 3 == 0:
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": {"path": f"f{i}"}}}
        return [
            {"role": "assistant", "content": f"Reading f{i}.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"line {i}\n" * 3},
            {"role": "tool", "tool_call_id": f"d{i}", "content": "second result"},
        ]
    return [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"next {i} ] }}"}]


def _grow(
    tokenizer: PreTrainedTokenizerBase, source: str, turns: int = 12, tools: Any = None
) -> tuple[list[int], list[int]]:
    """Grow a conversation turn by turn, each render replaying the previous one's record, and
    check it against a plain render; the iterations each render ran, and the conversation's sizes."""
    tokenizer.chat_template = source
    template = ChatTemplate(tokenizer)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Fix the build."},
    ]
    previous, rendered, sizes = None, [], []
    for i in range(turns):
        record = template.render_recorded(messages, tools, True, previous)
        plain = template.render(messages, tools, True)
        if record is None:  # a template that cannot be recorded: the caller renders it plainly
            rendered.append(len(messages))
        else:
            assert record.text == plain, f"turn {i}"
            rendered.append(record.rendered)
        sizes.append(len(messages))
        previous = record
        messages = [*messages, *_turn(i)]  # the same dict objects, as a kept history hands them over
    return rendered, sizes


@pytest.mark.parametrize("name", sorted(_REPLAYED))
def test_a_replayed_render_runs_only_what_the_conversation_added(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    rendered, sizes = _grow(tokenizer, _REPLAYED[name], tools=tools)
    assert rendered[0] >= sizes[0] - 1  # the first render ran every message (but a system message sliced off)
    for ran, size in zip(rendered[1:], sizes[1:], strict=True):
        assert ran <= 4 < size  # the appended messages and the old last one, however long the history
    assert sizes[-1] > 20


@pytest.mark.parametrize("name", sorted(_TRAPS))
def test_a_template_that_reads_beyond_a_message_is_rendered_again(
    tokenizer: PreTrainedTokenizerBase, name: str
) -> None:
    """Text equal to a plain render at every turn (checked in ``_grow``), whatever the template reads."""
    rendered, sizes = _grow(tokenizer, _TRAPS[name])
    if name in ("loop.last", "loop.nextitem"):
        assert all(ran <= 4 for ran in rendered[1:])  # only the old last message looked ahead
    else:
        assert sum(rendered) >= sum(sizes) - len(sizes)  # (nearly) everything ran again


def test_a_reasoning_template_is_rendered_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    """tiny-reasoning's template finds the last user query by a reversed pass: nothing is pasted."""
    rendered, sizes = _grow(tokenizer, TINY_REASONING_CHAT_TEMPLATE)
    assert all(ran >= size for ran, size in zip(rendered, sizes, strict=True))


def test_a_record_is_replayed_only_for_its_own_messages(tokenizer: PreTrainedTokenizerBase) -> None:
    """Equal but other message objects, other tools or other variables: no replay, the same text."""
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": f"m{i}"} if i % 2 == 0 else {"role": "assistant", "content": "a"}
                for i in range(9)]  # fmt: skip
    record = template.render_recorded(messages, None, True, None)
    assert record is not None
    copies = [dict(m) for m in messages] + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    again = template.render_recorded(copies, None, True, record)
    assert again is not None and again.rendered == len(copies) and again.text == template.render(copies, None, True)
    longer = [*messages, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    tools = [{"type": "function", "function": {"name": "read"}}]
    for other in (template.render_recorded(longer, tools, True, record),
                  template.render_recorded(longer, None, True, record, enable_thinking=False)):  # fmt: skip
        assert other is not None and other.rendered == len(longer)
    replayed = template.render_recorded(longer, None, True, record)
    assert replayed is not None and replayed.rendered == 2 and replayed.same_prefix > 0
    assert replayed.text == template.render(longer, None, True)
    assert replayed.text[: replayed.same_prefix] == record.text[: replayed.same_prefix]


def test_a_refusal_is_the_plain_renders(tokenizer: PreTrainedTokenizerBase) -> None:
    """A template that raises on a message raises the same when recorded, replayed or not."""
    source = _LOOP + "{% if message.content == 'bad' %}{{ raise_exception('no bad') }}{% endif %}" + _END
    tokenizer.chat_template = source
    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": "fine"}]
    record = template.render_recorded(messages, None, True, None)
    with pytest.raises(Exception, match="no bad") as recorded:
        template.render_recorded([*messages, {"role": "user", "content": "bad"}], None, True, record)
    with pytest.raises(Exception, match="no bad") as plain:
        template.render([*messages, {"role": "user", "content": "bad"}], None, True)
    assert type(recorded.value) is type(plain.value)
