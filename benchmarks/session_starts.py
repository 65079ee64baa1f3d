"""New agent sessions: the gateway CPU of a session's first turn when every session of the agent
sends the same system prompt and tool schemas (as Claude Code, Codex and OpenClaw do).

    .venv/bin/python benchmarks/session_starts.py --baseline-tree /tmp/before --sessions 30

Each session is new (its own session id, its own user message), so its first turn is a cold build:
the whole render tokenized, unless the pieces of it seen before are kept
(``stream_gateway/completion/_context.py``'s ``RenderPieces``). The system prompt is
``--system-chars`` characters of rules, with ``--tools`` tool schemas beside it. The gateways run
the synthetic engine (capture off, sessions in memory), each in its own process; the sessions go to
this checkout's gateway and to ``--baseline-tree``'s one after the other (the same bodies), and each
first turn's gateway CPU is read from ``/proc/<pid>/task/*/schedstat`` around it. Printed: the
median over the sessions after the first three (the ones that find the pieces kept), per gateway,
and their ratio; and the same for the time to the first token at the client.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import precise_cpu_s, wait_http
from agent_turns import _start_gateway

ROOT = Path(__file__).resolve().parents[1]


def _system(chars: int) -> str:
    rules, n = [], 0
    while sum(len(r) for r in rules) < chars:
        rules.append(f"- Rule {n}: before you edit a file, read it; keep each change small and say why it is safe.\n")
        n += 1
    return "You are a coding agent working in the user's repository.\n" + "".join(rules)


def _tools(count: int) -> list[dict[str, object]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}: reads, searches or edits files in the workspace. " * 4,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "a path inside the workspace"},
                        "pattern": {"type": "string", "description": "what to look for"},
                        "limit": {"type": "integer", "description": "at most this many results"},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(count)
    ]


def _first_token_s(client: httpx.Client, url: str, body: dict[str, object]) -> float:
    started = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: the turn's CPU is counted whole
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no content frame")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="the tokenizer and template (default: tiny)")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--system-chars", type=int, default=40_000, help="the shared system prompt's size")
    parser.add_argument("--tools", type=int, default=20, help="tool schemas sent with every request")
    parser.add_argument("--baseline-tree", type=Path, help="also run the gateway of this checkout, side by side")
    args = parser.parse_args()
    trees = [ROOT] + ([args.baseline_tree.resolve()] if args.baseline_tree else [])
    gateways = [_start_gateway(tree, args.model, 262_144) for tree in trees]
    system, tools = _system(args.system_chars), _tools(args.tools)
    cpu: list[list[float]] = [[] for _ in gateways]
    first: list[list[float]] = [[] for _ in gateways]
    try:
        for process, port in gateways:
            wait_http(f"http://127.0.0.1:{port}/health", process, 300)
        with httpx.Client(timeout=600) as client:
            for n in range(args.sessions):
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Session {n}: the build of module_{n} fails; find out why."},
                    ],
                    "tools": tools,
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "stream": True,
                }
                for i, (process, port) in enumerate(gateways):
                    url = f"http://127.0.0.1:{port}/sessions/start-{os.getpid()}-{n}/v1/chat/completions"
                    before = precise_cpu_s(process.pid)
                    first[i].append(_first_token_s(client, url, body))
                    cpu[i].append(precise_cpu_s(process.pid) - before)
                shown = ", ".join(f"{c[-1] * 1000:6.1f} ms CPU / {f[-1] * 1000:6.1f} ms to the first token"
                                  for c, f in zip(cpu, first, strict=True))  # fmt: skip
                print(f"session {n:3d}: {shown}", flush=True)
    finally:
        for process, _ in gateways:
            process.terminate()
            process.wait(30)
    names = ["this checkout", "baseline"]
    print(f"\nnew sessions after the first three ({args.sessions - 3}; system prompt {len(system):,} characters, "
          f"{args.tools} tools), medians:")  # fmt: skip
    medians = [
        (statistics.median(c[3:]) * 1000, statistics.median(f[3:]) * 1000) for c, f in zip(cpu, first, strict=True)
    ]
    for name, (c, f) in zip(names, medians, strict=False):
        print(f"  {name}: gateway CPU {c:.1f} ms per first turn, first token after {f:.1f} ms")
    if len(medians) == 2:
        (cpu_this, first_this), (cpu_base, first_base) = medians
        print(f"  this / baseline: CPU {cpu_this / cpu_base:.2f}, first token {first_this / first_base:.2f}")


if __name__ == "__main__":
    main()
