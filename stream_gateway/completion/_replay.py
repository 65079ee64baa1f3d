"""A chat template's render that re-renders only what a longer conversation changes.

An agent's next request repeats its whole history and appends a message or two; a Jinja chat
template renders every message again each time. Here a render is *recorded*: for every ``for`` loop
over ``messages`` (a ``LoopContext``, the loops that read ``loop.first`` / ``loop.last``...), where
each iteration's text starts in the output and what the iteration read. The next render of a
conversation that starts with the *same message objects* replays the leading iterations whose text
cannot have changed, pasting their recorded text, and runs the rest.

An iteration's text is a function of what it read, so it is replayed only when everything it read
is the same in the longer conversation:

* messages at positions the old conversation had (``messages[i]``, ``loop.previtem``; its own);
  ``loop.last`` and ``loop.nextitem`` read the *next* position, so the old last message's iteration
  (``loop.last`` was true, now false) is never replayed;
* nothing that depends on the conversation's length: ``loop.length``, ``loop.revindex``,
  ``messages | length``, ``messages[-1]``, slices other than ``messages[k:]``, iterating the whole
  list, ``reverse``, ``tojson``, its ``repr``: any of those makes the iteration *dirty*;
* no state shared between iterations: a ``namespace`` read or written, ``loop.changed``, a
  recursive loop, a loop over ``messages`` nested in the iteration: dirty.

Variables the template sets before the loop are read by the iterations invisibly (Python locals of
the compiled template), so a loop is replayed only when nothing before it read the conversation in
a length-dependent way or past its old end. ``set`` inside a loop cannot carry state between
iterations (jinja2 resets loop-scoped names each iteration; 3.1.6 read). ``strftime_now``,
``lipsum``, ``cycler``, ``joiner`` and the ``random`` filter make a render unrepeatable: never
replayed. A loop's text must reach the output as it is made: a loop inside a macro (output buffered
and returned) is not tracked, and a template with a ``{% filter %}`` or ``{% set %}...{% endset %}``
block around a ``for`` is never recorded. A template whose render fails when recorded (it hands
``messages`` to something that needs a real ``list``) is rendered again plainly: the recording
changes no text and no refusal.

The recorder sees the loops through a ``LoopContext`` subclass put into the compiled template's
globals (jinja2 3.1.6: compiled code names ``LoopContext`` from its module namespace) and
``messages`` as a read-only sequence that reports its reads (not a ``list``: C code that reads a
``list``'s items directly, ``json.dumps`` for one, cannot bypass it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import Template, nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.utils import Namespace

__all__ = ["RenderRecord", "TrackedLoop", "call_macro", "install_recording", "recorded_render", "tracking_read"]

# Globals whose result differs from one render to the next: a render that calls one is not replayed.
_VOLATILE_GLOBALS = ("strftime_now", "lipsum", "cycler", "joiner")
_VOLATILE_FILTERS = ("random",)

_active = threading.local()  # the recorder of the render running on this thread (renders run on threads)


@dataclass(slots=True)
class _Loop:
    """One recorded ``for`` loop over ``messages``: where each iteration's text starts, the highest
    message position each read (``-1``: dirty, never replayed), and where the loop's text ends."""

    base: int  # the loop runs over messages[base:]
    start: int  # output offset where the loop started
    prelude_clean: bool  # nothing before the loop read the conversation past ``prelude_reach`` or by length
    prelude_reach: int
    starts: list[int]
    reach: list[int]
    end: int = -1  # -1: the loop did not end normally (``break``, an exception)

    def replayable(self, known: int) -> int:
        """How many leading iterations can be pasted when the first ``known`` messages are the same."""
        if not self.prelude_clean or self.prelude_reach >= known or self.end < 0:
            return 0
        count = 0
        for reach in self.reach:
            if reach < 0 or reach >= known:
                break
            count += 1
        return count

    def segment_end(self, count: int) -> int:
        return self.starts[count] if count < len(self.starts) else self.end


@dataclass(frozen=True, slots=True)
class RenderRecord:
    """A recorded render: its text, what it rendered, and its loops (for the next render to replay).

    ``rendered``: iterations of loops over messages this render ran (replayed ones not counted);
    ``same_prefix``: leading characters of ``text`` known equal to the previous record's text
    (0 without one)."""

    text: str
    messages: Sequence[Mapping[str, Any]]
    tools: Any
    variables: Mapping[str, Any]
    loops: tuple[_Loop, ...]
    replayable: bool
    rendered: int
    same_prefix: int = 0

    def fits(self, messages: Sequence[Mapping[str, Any]], tools: Any, variables: Mapping[str, Any]) -> int:
        """How many leading messages of ``messages`` are this record's very objects (0: it cannot be
        replayed for this render: other tools or variables, or nothing recorded)."""
        if not self.replayable or tools != self.tools or variables != self.variables:
            return 0
        mine = self.messages
        known = min(len(mine), len(messages))
        for i in range(known):
            if messages[i] is not mine[i]:
                return i
        return known


class _Recorder:
    """What one render read and where its loops' iterations start."""

    __slots__ = ("_plans", "current", "dirty", "first_paste", "known", "loops", "offset", "outside_clean",
                 "outside_reach", "pieces", "previous", "reach", "rendered", "volatile")  # fmt: skip

    def __init__(self, previous: RenderRecord | None, known: int) -> None:
        self.pieces: list[str] = []
        self.offset = 0
        self.loops: list[_Loop] = []
        self.current: _Loop | None = None  # the loop whose iteration is running (None: outside every one)
        self.reach = -1  # the running iteration's highest message position read
        self.dirty = False
        self.outside_clean = True
        self.outside_reach = -1
        self.volatile = False
        self.rendered = 0
        self.previous = previous
        self.known = known
        self._plans = list(previous.loops) if previous is not None and known else []
        self.first_paste: tuple[int, int, int] | None = None  # the first loop's (start, old start, old end)

    def read(self, position: int) -> None:
        """A message position was read (``messages[i]``, the next or previous item)."""
        if self.current is not None:
            if position > self.reach:
                self.reach = position
        elif position > self.outside_reach:
            self.outside_reach = position

    def whole(self) -> None:
        """Something that depends on the conversation's length or all of it was read."""
        if self.current is not None:
            self.dirty = True
        else:
            self.outside_clean = False

    def loop_started(self, base: int) -> tuple[_Loop | None, int]:
        """A ``for`` over ``messages[base:]`` starts: its record (None: not tracked) and how many
        iterations to paste from the previous render."""
        if self.current is not None:  # a loop over messages inside an iteration: it reads them all
            self.dirty = True
            return None, 0
        loop = _Loop(base, self.offset, self.outside_clean, self.outside_reach, [], [])
        ordinal = len(self.loops)
        self.loops.append(loop)
        plan = self._plans[ordinal] if ordinal < len(self._plans) else None
        if plan is None or plan.base != base or self.previous is None:
            return loop, 0
        count = plan.replayable(self.known)
        if not count:
            return loop, 0
        first, last = plan.starts[0], plan.segment_end(count)
        self.paste(self.previous.text[first:last])
        if ordinal == 0:
            self.first_paste = (loop.start, plan.start, last)
        shift = loop.start - plan.start
        loop.starts = [s + shift for s in plan.starts[:count]]
        loop.reach = plan.reach[:count]
        return loop, count

    def paste(self, text: str) -> None:
        self.pieces.append(text)
        self.offset += len(text)

    def iteration(self, loop: _Loop, index: int) -> None:
        """Iteration ``index`` of ``loop`` starts (the previous one, if any, has ended)."""
        self.close()
        self.current = loop
        self.reach = loop.base + index
        self.dirty = False
        loop.starts.append(self.offset)
        self.rendered += 1

    def close(self, loop_ended: _Loop | None = None) -> None:
        """The running iteration ends (and with ``loop_ended``, its loop)."""
        current = self.current
        if current is not None:
            current.reach.append(-1 if self.dirty else self.reach)
            self.current = None
        if loop_ended is not None:
            loop_ended.end = self.offset


class _Messages(Sequence[Any]):
    """``messages`` as the template sees it while recorded: reads are reported, nothing else changes."""

    __slots__ = ("_base", "_items", "_recorder")

    def __init__(self, items: Sequence[Any], recorder: _Recorder, base: int = 0) -> None:
        self._items = items
        self._recorder = recorder
        self._base = base

    def __getitem__(self, key: Any) -> Any:
        if type(key) is int and key >= 0:
            self._recorder.read(self._base + key)
            return self._items[key]
        if type(key) is slice and key.step is None and key.stop is None and (key.start or 0) >= 0:
            start = key.start or 0  # messages[1:] (templates drop the system message so): a view
            return _Messages(self._items[start:], self._recorder, self._base + start)
        self._recorder.whole()
        return self._items[key]

    def __len__(self) -> int:
        self._recorder.whole()
        return len(self._items)

    def __bool__(self) -> bool:  # a longer conversation is as non-empty as the old one
        return bool(self._items)

    def __iter__(self) -> Iterator[Any]:
        self._recorder.whole()
        return self._counted()

    def _counted(self) -> Iterator[Any]:
        """The items, each counted as rendered (a loop the recorder cannot replay runs them all)."""
        recorder = self._recorder
        for item in self._items:
            recorder.rendered += 1
            yield item

    def __reversed__(self) -> Iterator[Any]:
        self._recorder.whole()
        items: Iterator[Any] = reversed(self._items)
        return items

    def __contains__(self, value: object) -> bool:
        self._recorder.whole()
        return value in self._items

    def __eq__(self, other: object) -> bool:
        self._recorder.whole()
        return list(self._items) == (list(other._items) if isinstance(other, _Messages) else other)

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Any) -> list[Any]:
        self._recorder.whole()
        return list(self._items) + list(other)

    def __radd__(self, other: Any) -> list[Any]:
        self._recorder.whole()
        return list(other) + list(self._items)

    def __repr__(self) -> str:
        self._recorder.whole()
        return repr(list(self._items))

    __str__ = __repr__


class TrackedLoop(LoopContext):
    """jinja2's ``LoopContext``; over ``messages`` it reports iterations and reads (jinja2 3.1.6 read)."""

    _record: _Loop | None = None
    _recorder: _Recorder | None = None

    def __init__(self, iterable: Any, undefined: Any, recurse: Any = None, depth0: int = 0) -> None:
        recorder = iterable._recorder if type(iterable) is _Messages else None
        if recorder is None:
            super().__init__(iterable, undefined, recurse, depth0)
            return
        if recurse is not None or _macro_depth():
            # A recursive loop, or one whose text a macro buffers: not tracked (its items counted).
            super().__init__(iterable, undefined, recurse, depth0)
            return
        record, skip = recorder.loop_started(iterable._base)
        items = iterable._items
        super().__init__(items[skip:] if skip else items, undefined, recurse, depth0)
        self._iterable = iterable  # ``length`` reads through it (and reports it)
        self._recorder, self._record = recorder, record
        if skip:  # the pasted iterations happened: the next is ``skip``, after items[skip - 1]
            self.index0 = skip - 1
            self._current = items[skip - 1]

    def __next__(self) -> tuple[Any, LoopContext]:
        recorder, record = self._recorder, self._record
        if record is None or recorder is None:
            return super().__next__()
        try:
            item = super().__next__()
        except StopIteration:
            recorder.close(record)
            raise
        recorder.iteration(record, self.index0)
        return item

    def _peek_next(self) -> Any:
        recorder = self._recorder
        if recorder is not None and self._record is not None:
            recorder.read(self._record.base + self.index0 + 1)
        return super()._peek_next()

    def changed(self, *value: Any) -> bool:
        if self._recorder is not None:
            self._recorder.whole()
        return super().changed(*value)

    def __call__(self, iterable: Any) -> str:
        if self._recorder is not None:
            self._recorder.whole()
        return super().__call__(iterable)


class _TrackedNamespace(Namespace):
    """jinja2's ``namespace()``: state shared between iterations, so its writes are reported."""

    def __setitem__(self, name: str, value: Any) -> None:
        recorder = getattr(_active, "recorder", None)
        if recorder is not None:
            recorder.whole()
        super().__setitem__(name, value)


def tracking_read(obj: Any) -> None:
    """Report a sandbox attribute or item read of ``obj`` (a namespace's state is shared)."""
    if isinstance(obj, Namespace):
        recorder = getattr(_active, "recorder", None)
        if recorder is not None:
            recorder.whole()


def _volatile(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        recorder = getattr(_active, "recorder", None)
        if recorder is not None:
            recorder.volatile = True
        return function(*args, **kwargs)

    return call


def _macro_depth() -> int:
    depth: int = getattr(_active, "macros", 0)
    return depth


def call_macro(function: Callable[..., Any], obj: Any, kwargs: Mapping[str, Any]) -> Any:
    """Run a sandbox call; a macro's (or a ``caller``'s) output is buffered, so loops in it are not tracked."""
    if not (isinstance(obj, Macro) or isinstance(kwargs.get("caller"), Macro)):
        return function()
    _active.macros = getattr(_active, "macros", 0) + 1
    try:
        return function()
    finally:
        _active.macros -= 1


def install_recording(template: Template, source: str) -> bool:
    """Put the recording hooks into ``template``'s environment and compiled namespace; whether its
    renders can be recorded (not when a ``filter`` or ``set`` block buffers a ``for`` loop's text)."""
    environment = template.environment
    tree = environment.parse(source)
    for block in (*tree.find_all(nodes.FilterBlock), *tree.find_all(nodes.AssignBlock)):
        if any(True for _ in block.find_all(nodes.For)):
            return False
    globals_: dict[str, Any] = dict(environment.globals)
    for name in _VOLATILE_GLOBALS:
        if name in globals_:
            globals_[name] = _volatile(globals_[name])
    globals_["namespace"] = _TrackedNamespace
    template.globals.update(globals_)
    environment.filters = {**environment.filters}
    for name in _VOLATILE_FILTERS:
        if name in environment.filters:
            environment.filters[name] = _volatile(environment.filters[name])
    template.root_render_func.__globals__["LoopContext"] = TrackedLoop
    return True


def recorded_render(
    template: Template,
    variables: dict[str, Any],
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    previous: RenderRecord | None,
) -> RenderRecord:
    """Render ``template`` with ``variables`` (``messages`` and ``tools`` among them), recorded,
    replaying what ``previous`` allows. Raises what the render raises."""
    known = previous.fits(messages, tools, _plain(variables)) if previous is not None else 0
    recorder = _Recorder(previous if known else None, known)
    context = template.new_context({**variables, "messages": _Messages(messages, recorder)})
    _active.recorder = recorder
    try:
        pieces = recorder.pieces
        for piece in template.root_render_func(context):
            pieces.append(piece)
            recorder.offset += len(piece)
    except Exception:
        template.environment.handle_exception()
    finally:
        _active.recorder = None
    recorder.close()
    text = "".join(recorder.pieces)
    same = 0
    if recorder.first_paste is not None and previous is not None:
        start, old_start, old_end = recorder.first_paste
        if start == old_start and text.startswith(previous.text[:start]):
            same = old_end  # the text before the loop, then the pasted iterations'
    return RenderRecord(
        text, messages, tools, _plain(variables), tuple(recorder.loops), not recorder.volatile, recorder.rendered, same
    )


def _plain(variables: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in variables.items() if k not in ("messages", "tools")}
