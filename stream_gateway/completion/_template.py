"""A model's chat template rendered exactly as ``tokenizer.apply_chat_template`` renders it, with
the sandbox's two most frequent checks answered without an exception.

Where this differs from calling ``apply_chat_template`` (transformers 5.10.4, jinja2 3.1.6 read):

* **The same environment.** The template is compiled by transformers' own (cached) compiler, so
  its filters (``tojson``), globals (``raise_exception``, ``strftime_now``), extensions and
  whitespace options are transformers'. The render gets the same variables: the tokenizer's
  special tokens, then the caller's, ``messages``, ``tools``, ``documents`` (none) and
  ``add_generation_prompt``.
* **Two attribute reads short-cut.** Every ``message.role``, ``message.content``, ``call.function``
  goes through ``SandboxedEnvironment.getattr``, which first tries a Python attribute: on a plain
  ``dict`` that raises ``AttributeError`` (built and caught, per read) before the key is looked up.
  Every ``loop.first`` / ``loop.index0`` is checked against the sandbox's rules for internal
  attributes. On a 400-message agent conversation those checks were about 60% of the render
  (docs/performance.md). Here a plain ``dict`` whose key is not the name of a ``dict`` attribute
  is read as the key (what the sandbox ends up doing), and a loop's public attributes are read
  directly (the sandbox allows all of them: it refuses names starting with ``_`` and the internals
  of functions, methods, types, frames and generators, none of which a ``LoopContext`` is).
  Everything else, dict subclasses and ``dict`` method names included, goes to the sandbox as
  before; the sandbox's refusals are unchanged. ``tests/unit/test_chat_template.py`` renders every
  built-in model's template both ways.
* Transformers without its template compiler (a private function), or with a sandbox other than
  jinja2's ``ImmutableSandboxedEnvironment``, renders through ``apply_chat_template`` itself.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from jinja2 import Template, TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

from stream_gateway.completion._replay import (
    RenderRecord,
    TrackedLoop,
    call_macro,
    install_recording,
    recorded_render,
    tracking_read,
)

_DICT_ATTRIBUTES = frozenset(dir(dict))
_MISSING = object()


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """Transformers' template sandbox with the short-cuts of the module docstring."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            value = obj.get(attribute, _MISSING)
            return self.undefined(obj=obj, name=attribute) if value is _MISSING else value
        if (kind is TrackedLoop or kind is LoopContext) and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass  # the sandbox's own answer (undefined)
        tracking_read(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tracking_read(obj)
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # jinja2's names
        parent = super().call
        return call_macro(lambda: parent(__context, __obj, *args, **kwargs), __obj, kwargs)


@functools.lru_cache(maxsize=16)
def _recordable(source: str) -> Template | None:
    """``source`` compiled as :func:`_compiled` does, with the recording hooks of :mod:`._replay`
    (``None``: it cannot be recorded)."""
    template = _compiled(source, fresh=True)
    if template is None or not install_recording(template, source):
        return None
    return template


@functools.lru_cache(maxsize=16)
def _compiled(source: str, fresh: bool = False) -> Template | None:
    """``source`` compiled in transformers' environment with this module's sandbox (``None``:
    this transformers has no template compiler to share)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    shared = _compile_jinja_template(source).environment
    if type(shared) is not ImmutableSandboxedEnvironment:
        return None  # a sandbox of transformers' own making: its rules, through apply_chat_template
    environment = shared.overlay()
    environment.__class__ = _ChatTemplateSandbox  # same configuration, the subclass's getattr
    template: Template = environment.from_string(source)
    return template


class ChatTemplate:
    """One tokenizer's chat template, rendered to text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._special = dict(tokenizer.special_tokens_map)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None, generation: bool, **kwargs: Any
    ) -> str:
        """The conversation as text (raises jinja2's ``TemplateError`` where the template refuses it)."""
        source = self._tokenizer.get_chat_template(None, tools)
        template = _compiled(source)
        if template is None:
            text = self._tokenizer.apply_chat_template(
                cast(Any, list(messages)), tools=cast(Any, tools), add_generation_prompt=generation, tokenize=False,
                **kwargs,
            )  # fmt: skip
            assert isinstance(text, str)
            return text
        variables = {**self._special, **kwargs}
        return template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=generation, **variables
        )

    def render_recorded(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation: bool,
        previous: RenderRecord | None,
        **kwargs: Any,
    ) -> RenderRecord | None:
        """The render of :meth:`render`, recorded (:mod:`._replay`) and replaying what ``previous``
        (the record of a conversation this one extends, message objects and all) allows; ``None``
        where this template cannot be recorded (the caller renders plainly)."""
        template = _recordable(self._tokenizer.get_chat_template(None, tools))
        if template is None:
            return None
        variables = {**self._special, **kwargs, "tools": tools, "documents": None, "add_generation_prompt": generation}
        try:
            return recorded_render(template, variables, messages, tools, previous)
        # What recording can add: C code or a filter that needs a real list (``tojson``, ``sort``)
        # meeting the reporting sequence. The plain render is the authority on text and refusals.
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError):
            text = self.render(messages, tools, generation, **kwargs)
            return RenderRecord(text, messages, tools, {}, (), False, len(messages))
