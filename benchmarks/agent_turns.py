"""Per-turn gateway CPU against the context a session carries (issue 41's "before" table).

One agent-shaped session: every turn echoes the previous answer and appends a tool result of
``--delta-tokens`` tokens, then asks for ``--output-tokens``. The gateway runs alone in its own
process (``serve --engine synthetic``, capture off, sessions in memory), so the CPU it spends on a
turn is read from its threads' ``/proc/<pid>/task/*/schedstat`` around the request (nanoseconds;
``/proc/<pid>/stat``'s 10 ms ticks are the size of what is measured), and the client's own CPU is not counted.
The table: context tokens at each turn, the gateway's CPU milliseconds for it, and that per 1k
tokens held. ``--profile FILE`` records the gateway with py-spy (speedscope JSON) for the whole run.

    .venv/bin/python benchmarks/agent_turns.py --max-context 131072 --delta-tokens 5400

``--protocol messages`` or ``responses`` sends the same conversation as Anthropic Messages (the
system prompt apart) or as Responses input items (the system prompt as ``instructions``);
``tokens`` sends it token-in to ``/v1/completions`` as an RL rollout does: the prompt ids of the
previous turn, its sampled ids (logprobs' ``token_id:N`` tokens) and the new messages' ids, tokenized here once each.

After the run, a new session's first turn carrying the conversation's first ``--cold-at`` tokens
is timed three times per gateway (a cold start: its whole render tokenized once).

A flat per-turn cost (O(delta)) shows as a flat CPU column; one that grows with the context shows
as a constant ms per 1k tokens. ``--baseline-tree DIR`` runs a second gateway from another checkout
(``git worktree add /tmp/before <commit>``) beside this one: every turn goes to both, one after
the other, and the table gets its column too (before/after in one run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import free_port, precise_cpu_s, rss_mb, wait_http

ROOT = Path(__file__).resolve().parents[1]
_WORDS = ("alpha", "build", "cargo", "delta", "error", "found", "green", "index", "json", "kernel", "lines", "merge")


def _tool_result(turn: int, words: int) -> str:
    """A tool result as an agent sends one: lines of file-ish text (different every turn)."""
    lines = []
    for i in range(0, words, 12):
        lines.append(f"{turn:04d}:{i:06d} " + " ".join(_WORDS[(turn + i + j) % len(_WORDS)] for j in range(12)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="the tokenizer and template (default: tiny)")
    parser.add_argument("--max-context", type=int, default=131072, help="stop once the context passes this")
    parser.add_argument("--delta-tokens", type=int, default=5400, help="tokens each turn appends (about)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens each turn asks for")
    parser.add_argument("--profile", help="py-spy record the gateway into this speedscope file")
    parser.add_argument("--baseline-tree", type=Path, help="also run the gateway of this checkout, side by side")
    parser.add_argument("--cold-at", type=int, default=50_000, help="then time cold starts of this much context")
    parser.add_argument(
        "--protocol", choices=sorted([*_PROTOCOLS, "tokens"]), default="chat", help="the wire format of the turns"
    )
    args = parser.parse_args(argv)

    trees = [ROOT] if args.baseline_tree is None else [ROOT, args.baseline_tree.resolve()]
    gateways = [_start_gateway(tree, args.model, args.max_context) for tree in trees]
    profiler = None
    try:
        ports = [port for _, port in gateways]
        for process, port in gateways:
            wait_http(f"http://127.0.0.1:{port}/health", process, 300)
        if args.profile:
            profiler = subprocess.Popen(["py-spy", "record", "-p", str(gateways[0][0].pid), "-f", "speedscope",
                                         "-o", args.profile, "-r", "200", "--nonblocking"])  # fmt: skip
        messages: list[dict[str, object]] = [{"role": "system", "content": "You are a coding agent."},
                                             {"role": "user", "content": "Fix the failing build."}]  # fmt: skip
        rows: list[tuple[int, list[float]]] = []
        cold_messages = 2
        words = max(1, args.delta_tokens // 4)  # the tiny tokenizer: about 4 tokens a word of these lines
        turn = 0
        with httpx.Client(timeout=600) as client:
            protocol = _protocol(args)
            while True:
                body = protocol.body(messages, args.output_tokens)
                spent, answers = [], []
                for (process, _), port in zip(gateways, ports, strict=True):
                    url = f"http://127.0.0.1:{port}/sessions/agent-{os.getpid()}{protocol.path}"
                    before = precise_cpu_s(process.pid)
                    answers.append(client.post(url, json=body).json())
                    spent.append(precise_cpu_s(process.pid) - before)
                answer = answers[0]
                context = protocol.context(answer)
                rows.append((context, spent))
                shown = ", ".join(f"{s * 1000:7.1f} ms" for s in spent)
                print(f"turn {turn:3d}: context {context:7d} tokens, gateway CPU {shown}, "
                      f"RSS {rss_mb(gateways[0][0].pid):.0f} MB", flush=True)  # fmt: skip
                if context > args.max_context:
                    break
                messages.append({"role": "assistant", "content": protocol.text(answer)})
                messages.append({"role": "user", "content": _tool_result(turn, words)})
                turn += 1
                if context <= args.cold_at:
                    cold_messages = len(messages)  # the first messages, up to about --cold-at tokens
            cold = _cold_starts(client, gateways, ports, messages[:cold_messages], args)
    finally:
        if profiler is not None:
            profiler.send_signal(2)
            profiler.wait(60)
        for process, _ in gateways:
            process.terminate()
            process.wait(30)
    _report(rows, args.baseline_tree is not None)
    shown = " / ".join(f"{ms:.1f} ms" for ms in cold[1])
    print(f"\ncold start (a new session's first turn) at {cold[0]:,} tokens of context: {shown} (median of 3)")


class _TokenIn:
    """The conversation as prompt ids, kept across turns the way a rollout keeps them: each new
    message tokenized once (ChatML, as the built-in models' templates render it), each answer
    appended as the ids it sampled."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        from stream_gateway.models import resolve_model

        self._tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
        self._ids: list[int] = []
        self._seen = 0
        self._sampled: list[int] = []
        self._generation = self._tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def body(self, messages: list[dict[str, object]], output: int) -> dict[str, object]:
        for message in messages[self._seen :]:
            if message["role"] == "assistant":
                self._ids += self._generation + self._sampled  # exactly what the previous turn held
            else:
                text = f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
                self._ids += self._tokenizer.encode(text, add_special_tokens=False)
        self._seen = len(messages)
        ids = self._ids + self._generation
        # The sampled ids as logprobs' ``token_id:N`` tokens: ``return_token_ids`` would also echo
        # the whole prompt's ids back (vLLM's contract), a response that grows with the context.
        return {"model": "m", "prompt": ids, "max_tokens": output, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True}  # fmt: skip

    def text(self, answer: dict[str, Any]) -> str:
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        self._sampled = [int(token.removeprefix("token_id:")) for token in tokens]
        return str(answer["choices"][0]["text"])


@dataclass(frozen=True)
class _Protocol:
    """One wire format: its route, a turn's body from chat-shaped messages, and its answer's parts."""

    path: str
    body: Callable[[list[dict[str, object]], int], dict[str, object]]
    text: Callable[[dict[str, Any]], str]
    context: Callable[[dict[str, Any]], int]


def _anthropic(messages: list[dict[str, object]], output: int) -> dict[str, object]:
    system, rest = messages[0]["content"], messages[1:]
    return {"model": "m", "system": system, "messages": rest, "max_tokens": output}


def _responses(messages: list[dict[str, object]], output: int) -> dict[str, object]:
    items = [{"type": "message", "role": m["role"], "content": m["content"]} for m in messages[1:]]
    return {"model": "m", "instructions": messages[0]["content"], "input": items, "max_output_tokens": output}


_PROTOCOLS = {
    "chat": _Protocol(
        "/v1/chat/completions",
        lambda messages, output: {"model": "m", "messages": messages, "max_tokens": output, "ignore_eos": True},
        lambda answer: str(answer["choices"][0]["message"]["content"]),
        lambda answer: int(answer["usage"]["prompt_tokens"]),
    ),
    "messages": _Protocol(
        "/v1/messages",
        _anthropic,
        lambda answer: "".join(b.get("text", "") for b in answer["content"]),
        lambda answer: int(answer["usage"]["input_tokens"]),
    ),
    "responses": _Protocol(
        "/v1/responses",
        _responses,
        lambda answer: "".join(c["text"] for o in answer["output"] if o["type"] == "message" for c in o["content"]),
        lambda answer: int(answer["usage"]["input_tokens"]),
    ),
}


def _protocol(args: argparse.Namespace) -> _Protocol:
    if args.protocol != "tokens":
        return _PROTOCOLS[args.protocol]
    tokens = _TokenIn(args.model)
    return _Protocol("/v1/completions", tokens.body, tokens.text, lambda answer: int(answer["usage"]["prompt_tokens"]))


def _cold_starts(
    client: httpx.Client,
    gateways: list[tuple[subprocess.Popen[bytes], int]],
    ports: list[int],
    messages: list[dict[str, object]],
    args: argparse.Namespace,
) -> tuple[int, list[float]]:
    """The gateway CPU of a new session's first turn carrying ``messages`` (its whole render
    tokenized once: a session's first turn, or one no replica holds), median of 3 per gateway."""
    protocol = _protocol(args)  # a new session: token-in tokenizes its messages afresh
    body = protocol.body(messages, args.output_tokens)
    spent: list[list[float]] = [[] for _ in gateways]
    context = 0
    for attempt in range(3):
        for i, ((process, _), port) in enumerate(zip(gateways, ports, strict=True)):
            url = f"http://127.0.0.1:{port}/sessions/cold-{os.getpid()}-{attempt}{protocol.path}"
            before = precise_cpu_s(process.pid)
            answer = client.post(url, json=body).json()
            spent[i].append((precise_cpu_s(process.pid) - before) * 1000)
            context = protocol.context(answer)
    return context, [statistics.median(s) for s in spent]


def _start_gateway(tree: Path, model: str, max_context: int) -> tuple[subprocess.Popen[bytes], int]:
    """The synthetic-engine gateway of checkout ``tree`` on a free port."""
    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic", "--model", model,
               "--served-model-name", "m", "--port", str(port), "--log-level", "warning", "--no-shared-sessions",
               "--max-model-len", str(max_context * 2), "--max-request-bytes", str(256 * 1024 * 1024)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    env["PYTHONPATH"] = str(tree)  # ahead of the editable install: that checkout's code
    return subprocess.Popen(command, env=env, cwd=tree), port


_POINTS = (8_000, 16_000, 50_000, 100_000, 200_000, 300_000, 400_000)


def _at_points(rows: list[tuple[int, list[float]]]) -> None:
    """The median per-turn CPU of the turns within 5% of each context size (the closing-note table)."""
    print("\n| context | turns | per turn, ms (median; each column a gateway) |\n|---:|---:|---|")
    for point in _POINTS:
        near = [spent for context, spent in rows[1:] if abs(context - point) <= 0.05 * point]
        if near:
            medians = " / ".join(f"{statistics.median(s[i] for s in near) * 1000:.1f}" for i in range(len(near[0])))
            print(f"| {point // 1000}k | {len(near)} | {medians} |")


def _report(rows: list[tuple[int, list[float]]], baseline: bool) -> None:
    _at_points(rows)
    if not baseline:
        print("\n| context tokens | gateway CPU per turn (ms) | ms per 1k tokens held |\n|---:|---:|---:|")
        for context, (spent,) in rows[1:]:
            print(f"| {context:,} | {spent * 1000:.1f} | {spent * 1e6 / context:.2f} |")
        steady = [spent[0] * 1e6 / context for context, spent in rows[len(rows) // 2 :]]
        print(f"\nmedian of the second half: {statistics.median(steady):.2f} ms per 1k tokens held")
        return
    print("\n| context tokens | this checkout (ms) | baseline (ms) | baseline / this |\n|---:|---:|---:|---:|")
    for context, (this, base) in rows[1:]:
        ratio = f"{base / this:.1f}x" if this else "-"
        print(f"| {context:,} | {this * 1000:.1f} | {base * 1000:.1f} | {ratio} |")
    half = rows[len(rows) // 2 :]
    this_med = statistics.median(s[0] for _, s in half) * 1000
    base_med = statistics.median(s[1] for _, s in half) * 1000
    print(f"\nmedians of the second half: this checkout {this_med:.1f} ms per turn, baseline {base_med:.1f} ms")


if __name__ == "__main__":
    main()
