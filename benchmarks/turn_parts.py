"""What each part of a continuing turn's prompt build costs, timed alone, at growing contexts.

The conversation is ``agent_turns.py``'s (each turn an answer and a tool result of
``--delta-tokens`` tokens). At each ``--contexts`` size the body is built, then each part that reads
the whole history is timed on its own (median of ``--repeat``): the body's parse and validation,
the message fingerprints, the messages as the template takes them, the chat template's render as
``apply_chat_template`` does it and as the gateway does it (``completion/_template.py``, the same
text without the sandbox's per-read exceptions), and the render anchor's digest. Then the same
reads when the previous request's are kept (``completion/_history.py``, what a continuing turn
does): the body read through the kept history (only the new messages parsed and validated), the
conversation keys extended from the kept ones, and the render replaying the previous request's
recorded render (``completion/_replay.py``). The last row is the new tool result's tokenization,
which does not grow with the context.

    .venv/bin/python benchmarks/turn_parts.py --contexts 10000 100000 400000
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from transformers import AutoTokenizer

from stream_gateway.completion import (
    ChatCompletionRequest,
    ChatTemplate,
    Histories,
    KeptHistory,
    conversation_keys,
    message_fingerprint,
    prefix_keys,
    template_message,
    tools_fingerprint,
)
from stream_gateway.http import decode_body
from stream_gateway.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_turns import _tool_result


def _conversation(tokenizer: Any, context: int, delta_tokens: int) -> list[dict[str, Any]]:
    """agent_turns.py's session, grown to about ``context`` tokens (counted on the tokenizer)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Fix the failing build."}]  # fmt: skip
    tokens, turn = 0, 0
    while tokens < context:
        result = _tool_result(turn, max(1, delta_tokens // 4))
        messages += [{"role": "assistant", "content": "Reading the next file."}, {"role": "user", "content": result}]
        tokens += len(tokenizer.encode(result, add_special_tokens=False)) + 12
        turn += 1
    return messages


def _timed_parse(kept: Callable[[], tuple[Histories, Any]], raw: bytes, repeat: int) -> Callable[[], object]:
    """Parse ``raw`` through a freshly kept history each time (the keeping not timed)."""
    ready = [kept()[0] for _ in range(repeat)]
    return lambda: ready.pop().parse(raw, ChatCompletionRequest)


def _median_ms(work: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="the tokenizer and template (default: tiny)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[10_000, 100_000, 400_000])
    parser.add_argument("--delta-tokens", type=int, default=2000, help="tokens each turn appends (about)")
    parser.add_argument("--repeat", type=int, default=9, help="timings per part; the median is shown")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    template = ChatTemplate(tokenizer)
    columns: list[tuple[str, dict[str, float]]] = []
    for context in args.contexts:
        messages = _conversation(tokenizer, context, args.delta_tokens)
        raw = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 64})
        request = ChatCompletionRequest.model_validate(orjson.loads(raw))
        rendered = [template_message(m) for m in request.messages]
        full = template.render(rendered, None, True)
        delta = str(messages[-1]["content"])
        before = orjson.dumps({"model": "m", "messages": messages[:-2], "max_tokens": 64})

        def kept(before: bytes = before) -> tuple[Histories, ChatCompletionRequest]:
            """A history kept from the request before (its keys and render recorded, as served)."""
            histories = Histories(1 << 34, decode_body)
            earlier = histories.parse(before, ChatCompletionRequest)
            conversation_keys(earlier)
            history = KeptHistory.of(earlier)
            rendered = history.each("templated", earlier.messages, template_message)
            history.recorded_render(lambda _: template.render_recorded(rendered, None, True, None))
            return histories, earlier

        def continued(work: Callable[[ChatCompletionRequest], object], raw: bytes = raw) -> Callable[[], object]:
            """``work`` on this turn's body read through a kept history (the setup not timed)."""
            ready = [kept() for _ in range(args.repeat)]
            bodies = [histories.parse(raw, ChatCompletionRequest) for histories, _ in ready]
            return lambda: work(bodies.pop())

        def replayed(body: ChatCompletionRequest) -> object:
            history = KeptHistory.of(body)
            rendered = history.each("templated", body.messages, template_message)
            return history.recorded_render(lambda earlier: template.render_recorded(rendered, None, True, earlier))

        def fingerprints(req: ChatCompletionRequest = request) -> object:
            return prefix_keys(tools_fingerprint(None), [message_fingerprint(m) for m in req.messages])

        def sandbox(conversation: list[dict[str, Any]] = rendered) -> object:
            return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

        parts = {
            "body: orjson.loads and pydantic validation": lambda r=raw: ChatCompletionRequest.model_validate(
                orjson.loads(r)
            ),
            "message fingerprints": fingerprints,
            "messages as the template takes them": lambda req=request: [template_message(m) for m in req.messages],
            "render: apply_chat_template (Jinja's sandbox)": sandbox,
            "render: the gateway's (completion/_template.py)": lambda c=rendered: template.render(c, None, True),
            "render anchor digest (blake2b of the render)": lambda f=full: hashlib.blake2b(
                f.encode("utf-8", "surrogatepass"), digest_size=16
            ).digest(),
            "kept history: the body (only the new messages read)": _timed_parse(kept, raw, args.repeat),
            "kept history: conversation keys (the new messages')": continued(conversation_keys),
            "kept history: the render, replayed": continued(replayed),
            "the new tool result's tokenization": lambda d=delta: tokenizer.encode(d, add_special_tokens=False),
        }
        label = f"{len(tokenizer.encode(full, add_special_tokens=False)) // 1000}k ({len(messages)} messages)"
        columns.append((label, {name: _median_ms(work, args.repeat) for name, work in parts.items()}))
        print(f"timed {label}", file=sys.stderr, flush=True)

    print("| part | " + " | ".join(label for label, _ in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name in columns[0][1]:
        print(f"| {name} | " + " | ".join(f"{times[name]:.2f} ms" for _, times in columns) + " |")


if __name__ == "__main__":
    main()
