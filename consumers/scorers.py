"""Scorers: what the reward worker runs on a trajectory (``--scorer NAME=SPEC``).

Kinds of ``SPEC``:

* ``python:MODULE:FUNCTION``: the function is called with the trajectory's document (below) and
  returns a number, or a dict (below); it may be ``async``. A plain function runs in a worker
  thread, so its time limit holds for the worker (a thread cannot be killed: one that never returns
  keeps its thread; use ``command:`` for code that may hang);
* ``command:CMD``: ``CMD`` split as a shell would (:func:`shlex.split`) but run without one, the
  document as JSON on standard input; standard output is a JSON number or object. A non-zero exit is
  an error (the end of its standard error says why). On its time limit the process and every process
  it started (its own session) are killed;
* ``judge:URL#MODEL``: an OpenAI-compatible chat completions API asked with a prompt
  (:mod:`consumers.judge`);
* ``signals`` or ``signals:SIGNAL=WEIGHT,...``: built in, the turns' implicit signals (retried,
  edited, a failed tool call, abandoned, accepted) weighed into a reward (:mod:`consumers.signals`).

**The document** is the trajectory as published on the trajectories stream (a dict: ids, masks,
``turns``, ``metadata``, ``reward`` ...), and, when the worker has a tokenizer for its model
(``--tokenizer``), its text: ``transcript`` (every id decoded, the chat template's markers kept),
``prompt`` (the first prompt), and on each turn ``text`` (what it sampled) and ``context`` (what was
appended before it: tool results, the user's next message). Scorers share one document: read it,
do not change it.

**An answer** (a function's return value, a command's output, a judge's JSON): a number (``true``
and ``false`` count as 1 and 0) is the score; an object gives ``score`` (the scorer's score),
``turns`` (a list with one number or ``null`` per turn of the trajectory, in order: per-turn
scores) and named numbers (every other numeric entry, a part: ``tests.passed`` in a formula); other
entries are ignored. ``None``, ``NaN`` or a ``turns`` list of another length is an error.

Each scorer has a time limit per try (``timeout_s``, a cancel scope around the try), a bound on
tries running at once (``concurrency``, a capacity limiter) and ``retries``: a try that fails or
times out is tried again after 0.5 s, 1 s, 2 s ... (at most 5 s); the verdict is the last try's.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import orjson

from .scores import SCORER_NAME
from .signals import parse_weights, signals_answer

__all__ = [
    "Scorer",
    "ScorerSpec",
    "ScoreValue",
    "Tokenizers",
    "Verdict",
    "scoring_document",
    "parse_scorer",
    "score_value",
]

Kind = Literal["python", "command", "judge", "signals"]
Attempt = Callable[[dict[str, Any]], Awaitable["ScoreValue"]]

_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 5.0
_STDERR_TAIL = 500


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """One ``--scorer NAME=SPEC``, with its limits."""

    name: str
    kind: Kind
    target: str  # MODULE:FUNCTION, the command line, URL#MODEL, or signal weights
    timeout_s: float = 30.0
    concurrency: int = 8
    retries: int = 1

    @property
    def spec(self) -> str:
        """``KIND:TARGET`` as given."""
        return f"{self.kind}:{self.target}" if self.target or self.kind != "signals" else self.kind


def parse_scorer(text: str) -> ScorerSpec:
    """``NAME=python:MODULE:FUNCTION``, ``NAME=command:CMD``, ``NAME=judge:URL#MODEL`` or
    ``NAME=signals[:SIGNAL=WEIGHT,...]``."""
    name, equals, spec = text.partition("=")
    if not equals or SCORER_NAME.fullmatch(name) is None:
        raise ValueError(f"--scorer {text!r}: expected NAME=SPEC, NAME letters, digits and _ (not first a digit)")
    kind, _, target = spec.partition(":")
    if kind == "signals":
        parse_weights(target)  # a bad weight fails at start
        return ScorerSpec(name, "signals", target)
    if kind not in ("python", "command", "judge") or not target:
        raise ValueError(
            f"--scorer {text!r}: SPEC is python:MODULE:FUNCTION, command:CMD, judge:URL#MODEL or signals[:WEIGHTS]"
        )
    if kind == "python" and not all(target.partition(":")[::2]):
        raise ValueError(f"--scorer {text!r}: expected python:MODULE:FUNCTION")
    if kind == "command" and not shlex.split(target):
        raise ValueError(f"--scorer {text!r}: an empty command")
    if kind == "judge" and (not target.partition("#")[2] or "://" not in target):
        raise ValueError(f"--scorer {text!r}: expected judge:http://HOST:PORT/v1#MODEL")
    return ScorerSpec(name, kind, target)  # type: ignore[arg-type]  # kind checked above


@dataclass(frozen=True, slots=True)
class ScoreValue:
    """What one try gave: the score, named parts, per-turn scores, and a judge's answer."""

    score: float | None
    parts: dict[str, float] = field(default_factory=dict)
    turns: list[float | None] | None = None
    answer: str | None = None


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(f"{what}: expected a finite number, got {value!r}")


def score_value(answer: Any, turns: int) -> ScoreValue:
    """An answer (module docstring) as a :class:`ScoreValue`; ``ValueError`` when it is none."""
    if not isinstance(answer, dict):
        score = _number(answer, "score")
        if score is None:
            raise ValueError("no score (None)")
        return ScoreValue(score)
    score = _number(answer.get("score"), "score")
    parts = {
        str(k): float(v)
        for k, v in answer.items()
        if k not in ("score", "turns") and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    per_turn = answer.get("turns")
    if per_turn is not None:
        if not isinstance(per_turn, list) or len(per_turn) != turns:
            raise ValueError(f"turns: expected a list of {turns} numbers (one per turn), got {per_turn!r}")
        per_turn = [_number(v, "turns[]") for v in per_turn]
    if score is None and not parts and per_turn is None:
        raise ValueError(f"no score in {answer!r}")
    return ScoreValue(score, parts, per_turn)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A scorer's last word on one trajectory."""

    status: Literal["scored", "timeout", "error"]
    value: ScoreValue | None
    error: str | None
    attempts: int
    duration_s: float


class Scorer:
    """One scorer's spec, its tries (:meth:`run`) and its limits; ``attempt`` scores a document once."""

    def __init__(self, spec: ScorerSpec, attempt: Attempt) -> None:
        self.spec = spec
        self._attempt = attempt
        self._limiter = anyio.CapacityLimiter(spec.concurrency)

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    def python(cls, spec: ScorerSpec) -> Scorer:
        """A ``python:MODULE:FUNCTION`` scorer (the function imported now: a missing one fails at start)."""
        module_name, _, name = spec.target.partition(":")
        function = getattr(importlib.import_module(module_name), name, None)
        if not callable(function):
            raise ValueError(f"--scorer {spec.name}: {module_name} has no callable {name!r}")

        async def attempt(document: dict[str, Any]) -> ScoreValue:
            if inspect.iscoroutinefunction(function):
                answer = await function(document)
            else:  # in a thread, so that the time limit holds for the worker
                answer = await anyio.to_thread.run_sync(function, document, abandon_on_cancel=True)
                if inspect.isawaitable(answer):
                    answer = await answer
            return score_value(answer, len(document["turns"]))

        return cls(spec, attempt)

    @classmethod
    def command(cls, spec: ScorerSpec) -> Scorer:
        """A ``command:CMD`` scorer."""
        argv = shlex.split(spec.target)

        async def attempt(document: dict[str, Any]) -> ScoreValue:
            output = await run_command(argv, orjson.dumps(document))
            try:
                answer = orjson.loads(output)
            except orjson.JSONDecodeError:
                raise ValueError(f"standard output is not JSON: {output[:200]!r}") from None
            return score_value(answer, len(document["turns"]))

        return cls(spec, attempt)

    @classmethod
    def signals(cls, spec: ScorerSpec) -> Scorer:
        """The built-in ``signals`` scorer (:func:`consumers.signals.signals_answer`), its weights from the spec."""
        weights = parse_weights(spec.target)

        async def attempt(document: dict[str, Any]) -> ScoreValue:
            return score_value(signals_answer(document, weights), len(document["turns"]))

        return cls(spec, attempt)

    async def run(self, document: dict[str, Any]) -> Verdict:
        """Try up to ``1 + retries`` times, each within ``timeout_s``; the verdict of the last try."""
        spec, started = self.spec, time.monotonic()
        delay, error = _RETRY_FIRST_S, ""
        status: Literal["timeout", "error"] = "error"
        for attempt in range(1, spec.retries + 2):
            if attempt > 1:
                await anyio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
            async with self._limiter:
                try:
                    with anyio.fail_after(spec.timeout_s):
                        value = await self._attempt(document)
                except TimeoutError:
                    status, error = "timeout", f"no answer within {spec.timeout_s:g} s"
                    continue
                except Exception as exc:  # a scorer's failure is recorded, never the worker's end
                    status, error = "error", f"{type(exc).__name__}: {exc}"[:1000]
                    continue
            return Verdict("scored", value, None, attempt, time.monotonic() - started)
        return Verdict(status, None, error, spec.retries + 1, time.monotonic() - started)


async def run_command(argv: list[str], stdin: bytes) -> bytes:
    """Run ``argv`` with ``stdin``; its standard output. A non-zero exit raises ``RuntimeError``; a
    cancellation (the time limit) kills the process's whole session before it propagates."""
    process = await anyio.open_process(argv, start_new_session=True)
    out: list[bytes] = []
    err: list[bytes] = []

    async def drain(stream: Any, into: list[bytes]) -> None:
        async for chunk in stream:
            into.append(chunk)

    async def feed() -> None:
        assert process.stdin is not None
        try:
            await process.stdin.send(stdin)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # it exited without reading it all
            pass
        finally:
            await process.stdin.aclose()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, process.stdout, out)
            tg.start_soon(drain, process.stderr, err)
            tg.start_soon(feed)
            await process.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await process.aclose()
    if process.returncode != 0:
        tail = b"".join(err)[-_STDERR_TAIL:].decode(errors="replace").strip()
        raise RuntimeError(f"{argv[0]} exited with {process.returncode}" + (f": {tail}" if tail else ""))
    return b"".join(out)


class Tokenizers:
    """The tokenizer of each model (``--tokenizer [MODEL=]DIR``), loaded on first use; one given
    without a model name serves every model."""

    def __init__(self, paths: Mapping[str, str]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._paths)

    async def get(self, model: str) -> Any | None:
        """The tokenizer of ``model``, ``None`` when none was given for it."""
        if model not in self._loaded:
            path = self._paths.get(model) or self._paths.get("")
            self._loaded[model] = None if path is None else await anyio.to_thread.run_sync(_load_tokenizer, path)
        return self._loaded[model]


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def scoring_document(trajectory: dict[str, Any], tokenizer: Any | None) -> dict[str, Any]:
    """The document scorers get (module docstring): the published trajectory, and its text if a
    tokenizer is given."""
    if tokenizer is None:
        return trajectory
    ids: list[int] = trajectory["token_ids"]
    prompt_length = trajectory["prompt_length"]
    turns, end = [], prompt_length
    for turn in trajectory["turns"]:
        start, stop = turn["start"], turn["start"] + turn["length"]
        context = tokenizer.decode(ids[end:start], skip_special_tokens=True) if start > end else ""
        turns.append({**turn, "text": tokenizer.decode(ids[start:stop], skip_special_tokens=True), "context": context})
        end = max(end, stop)
    return {
        **trajectory,
        "turns": turns,
        "transcript": tokenizer.decode(ids),
        "prompt": tokenizer.decode(ids[:prompt_length]),
    }
