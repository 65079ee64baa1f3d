"""The ``scripted`` engine: a real model that answers what a script says, with its real logprobs.

Tests of a protocol, a pipeline or an agent need a particular answer (a tool call to whichever
tool is offered, a thought, a colour), and a model that learned to give it is slow to build and
moves with a CPU's float code paths. This engine gives the answer a :class:`~._script.Script`
states instead, and everything else is the ``transformers`` engine's, unchanged: the model is
loaded and run, requests are batched, every output token is fed through a forward pass, and each
step's logprob is that token's under the distribution the model would have drawn it from
(temperature, top-k, top-p; a teacher-forced pass over the scripted ids). So a recorded turn is
exactly as strict as a sampled one: a forward pass of the same (untrained) weights over the
trajectory reproduces every logprob, and weight updates, LoRA adapters, images and mixtures of
experts behave as on the ``transformers`` engine.

How an answer is chosen: the prompt ids are decoded and read as the chat template laid them out
(:class:`~._script.PromptView`); the first rule that holds gives a reply (a thought on a thinking
model, text, tool calls in the model's own ``<tool_call>`` format), tokenized by the model's
tokenizer and ended with the end-of-turn token. The worker emits those ids one per step
(``max_tokens``, stop ids and stop strings end it early as for a sampled answer). A request whose
grammar (``response_format``, ``tool_choice``) refuses a scripted token is not broken: the grammar
masks the token as it would a model's choice, and the model samples from there on. After the
script's last token (``ignore_eos``) the model samples too. ``n``, seeds and temperature apply to
what the model samples; a scripted token is the same whatever they are.

Deliberate choices:

* A subclass of the transformers engine rather than a wrapper: the batch loop, isolation,
  weight updates and adapters are one implementation, and a scripted row differs from a sampled
  one in a single place (``_sampling.sample_batch``'s ``forced`` tokens).
* Reading the prompt happens off the event loop (decoding a 40k-token agent prompt takes a few
  milliseconds), once per request.
* ``--script-tokens-per-second`` paces the stream for demos and disconnect tests; 0 streams as fast
  as the forward passes run.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from pipeline.vision import ProcessedImage

from stream_gateway.engines._base import EngineStep, SamplingParams
from stream_gateway.engines._script import (
    DEFAULT_SCRIPT,
    PromptView,
    Script,
    dominant_colour,
    load_script,
    render_reply,
)
from stream_gateway.engines.transformers import TransformersEngine
from stream_gateway.engines.transformers import engine_options as transformers_options
from stream_gateway.reasoning import resolve_reasoning_format

if TYPE_CHECKING:
    from stream_gateway._settings import Settings

__all__ = ["DEFAULT_SCRIPT", "Script", "ScriptedEngine", "create_engine", "engine_options", "load_script"]


class ScriptedEngine(TransformersEngine):
    """The transformers engine answering by ``script`` (default: :data:`DEFAULT_SCRIPT`)."""

    name = "scripted"

    def __init__(
        self,
        model: str | Path,
        *,
        script: Script | None = None,
        tokens_per_second: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(model, **options)
        self.script = script or DEFAULT_SCRIPT
        self._interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self._think_tags: tuple[str, str] | None = None
        self._prompt_opens_thought = False
        self._end_of_turn: list[int] = []
        self._image_token: str | None = None  # a vision-language model's placeholder, as decoded text

    async def __aenter__(self) -> ScriptedEngine:
        await super().__aenter__()
        tokenizer = self.tokenizer
        fmt = resolve_reasoning_format("auto", tokenizer)
        if fmt is not None:
            self._think_tags = (str(tokenizer.decode([fmt.start_id])), str(tokenizer.decode([fmt.end_id])))
            self._prompt_opens_thought = fmt.name == "deepseek_r1"
        # The turn ends as the template ends an assistant turn: the tokenizer's end-of-sequence token
        # (ChatML's <|im_end|>), else the smallest of the model's own end-of-turn ids.
        eos = tokenizer.eos_token_id
        self._end_of_turn = [eos] if isinstance(eos, int) else [min(self._m.eos_ids)] if self._m.eos_ids else []
        if self.vision is not None:
            self._image_token = str(tokenizer.decode([self.vision.token_id]))
        return self

    def answer(self, prompt_ids: Sequence[int], images: Sequence[ProcessedImage] = ()) -> list[int]:
        """The ids the script answers ``prompt_ids`` with, end-of-turn token included."""
        text = str(self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        view = PromptView.read(text, image_token=self._image_token, think_tags=self._think_tags)
        rule = self.script.reply(view)
        if rule is None:
            return list(self._end_of_turn)
        reply = render_reply(
            rule,
            view,
            model=self.model_id,
            colour=dominant_colour([image.data for image in images]) if "{colour}" in rule.say else None,
            think_tags=self._think_tags,
            prompt_opens_thought=self._prompt_opens_thought,
        )
        return [*self.tokenizer.encode(reply, add_special_tokens=False), *self._end_of_turn]

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
        script: Sequence[int] | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        """The transformers engine's stream, its tokens the script's (``script``: these ids instead)."""
        if script is None:
            script = await anyio.to_thread.run_sync(self.answer, prompt_ids, images)
        steps = super().generate(request_id, prompt_ids, params, affinity=affinity, images=images, script=script)
        async with aclosing(steps):
            async for step in steps:
                if self._interval:
                    await anyio.sleep(self._interval * len(step.token_ids))
                yield step


def engine_options(name: str, settings: Settings) -> dict[str, Any]:
    """The engine's constructor arguments from a process's settings (see :mod:`.registry`)."""
    options = transformers_options(name, settings)
    options["tokens_per_second"] = settings.script_tokens_per_second
    if settings.script is not None:
        try:
            options["script"] = load_script(settings.script)
        except ValueError as exc:
            raise SystemExit(f"stream-gateway: --script: {exc}") from exc
    return options


def create_engine(name: str, model: str | Path, **options: Any) -> ScriptedEngine:
    """A :class:`ScriptedEngine` on ``model`` (see :mod:`.registry`)."""
    return ScriptedEngine(model, **options)
