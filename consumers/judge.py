"""LLM judges: ``--scorer NAME=judge:URL#MODEL``, a model behind an OpenAI-compatible API scoring a trajectory.

``URL`` is the API's base (``http://host:port/v1``); each try sends one chat completion request
(``POST {URL}/chat/completions``, one user message, temperature 0) whose message is the prompt
template filled in with the trajectory's text. The template (``--judge-template FILE``, else
:data:`DEFAULT_TEMPLATE`, which asks for a score from 0 to 1 as JSON) may use:

``{transcript}``  the whole trajectory decoded, the chat template's markers kept
``{prompt}``      its first prompt (system prompt, the user's first message)
``{last_answer}`` what its last turn sampled
``{metadata}``    the session's metadata, as JSON
``{model}``, ``{trajectory_id}``

(``{{`` and ``}}`` are literal braces). The text needs the model's tokenizer: the worker refuses to
start a judge without ``--tokenizer``.

**The score** is read off the answer by one rule: when the answer is JSON (a fenced code block
around it is taken off), as any scorer's answer (:func:`consumers.scorers.score_value`: a number,
or an object's ``score``, per-turn ``turns`` and named parts); otherwise the first number after the
last word "score" (``Score: 0.8``, ``final score is 7``). An answer with neither is an error (tried
again as the scorer's retries allow). The answer's text is kept beside the score (its first 4000
characters), so a person can see why.

Deliberate choices:

* **Recording off.** Every request carries ``X-Capture: off``: when the judge is this gateway, its
  answers are not captured as training data of their own (a key whose tenant requires capture is
  refused with 403, recorded as the judge's error). Other servers ignore the header.
* One ``httpx.AsyncClient`` per judge, opened and closed with the worker (:meth:`JudgeScorer.open`);
  its own timeout is the scorer's time limit plus a second, a backstop to the cancel scope around
  each try.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from .scorers import Scorer, ScorerSpec, ScoreValue, score_value

__all__ = ["DEFAULT_TEMPLATE", "JudgeScorer", "judge_score", "load_template"]

DEFAULT_TEMPLATE = """You are grading an AI assistant's work in the conversation below.

<conversation>
{transcript}
</conversation>

How well did the assistant's last answer serve the user: is it correct, complete and helpful?
Reply with JSON only, {{"score": S}}, where S is a number from 0 (useless or wrong) to 1 (fully \
correct and helpful)."""

CAPTURE_OFF = {"x-capture": "off"}

_FIELDS = {"transcript", "prompt", "last_answer", "metadata", "model", "trajectory_id"}
_ANSWER_KEPT = 4000
_FENCE = re.compile(r"^```[A-Za-z]*\s*(.*?)\s*```$", re.DOTALL)
_SCORE = re.compile(r"(?i)\bscore\b")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def load_template(path: str | Path | None) -> str:
    """The template in ``path`` (``None``: the default), checked: only the fields above."""
    template = DEFAULT_TEMPLATE if path is None else Path(path).read_text()
    try:
        template.format_map(dict.fromkeys(_FIELDS, ""))
    except (KeyError, IndexError, ValueError) as exc:
        fields = ", ".join(sorted(_FIELDS))
        raise ValueError(f"--judge-template {path}: {exc!r}; fields are {fields} (write a brace twice)") from None
    return template


def judge_score(answer: str, turns: int) -> ScoreValue:
    """The score in a judge's answer, by the rule of the module docstring."""
    text = answer.strip()
    fenced = _FENCE.match(text)
    try:
        parsed = orjson.loads(fenced[1] if fenced else text)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict | int | float) and not isinstance(parsed, bool):
        value = score_value(parsed, turns)
    else:
        found = list(_SCORE.finditer(text))
        number = _NUMBER.search(text, found[-1].end()) if found else None
        if number is None:
            raise ValueError("no score in the judge's answer")
        value = ScoreValue(float(number[0]))
    return ScoreValue(value.score, value.parts, value.turns, answer[:_ANSWER_KEPT])


class JudgeScorer:
    """A ``judge:URL#MODEL`` scorer's client; :meth:`open` yields the :class:`Scorer` using it."""

    def __init__(self, spec: ScorerSpec, template: str, *, api_key: str | None = None, max_tokens: int = 512) -> None:
        base_url, _, self.model = spec.target.partition("#")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.spec = spec
        self._template = template
        self._headers = {**CAPTURE_OFF, **({"authorization": f"Bearer {api_key}"} if api_key else {})}
        self._max_tokens = max_tokens

    def prompt(self, document: dict[str, Any]) -> str:
        """The template filled in with ``document``'s text (:func:`consumers.scorers.scoring_document`)."""
        if "transcript" not in document:
            raise ValueError(f"no tokenizer for model {document.get('model')!r}: the judge needs text (--tokenizer)")
        turns = document["turns"]
        return self._template.format_map({
            "transcript": document["transcript"], "prompt": document["prompt"],
            "last_answer": turns[-1]["text"] if turns else "",
            "metadata": orjson.dumps(document.get("metadata") or {}).decode(),
            "model": document.get("model", ""), "trajectory_id": document["trajectory_id"],
        })  # fmt: skip

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Scorer]:
        """The scorer, its HTTP client open until the block exits."""
        import httpx

        async with httpx.AsyncClient(timeout=self.spec.timeout_s + 1.0, headers=self._headers) as client:

            async def attempt(document: dict[str, Any]) -> ScoreValue:
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": self.prompt(document)}],
                    "temperature": 0.0,
                    "max_tokens": self._max_tokens,
                    "stream": False,
                }
                response = await client.post(self.url, json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{self.url} answered {response.status_code}: {response.text[:300]}")
                content = response.json()["choices"][0]["message"].get("content") or ""
                return judge_score(content, len(document["turns"]))

            yield Scorer(self.spec, attempt)
