"""The console at scale: the first page with 100,000 sessions stored, and a 1M-token trajectory.

Run (from the repository root, after ``bash scripts/test.sh`` has built the tiny model and
installed Chromium)::

    .venv/bin/python benchmarks/console_scale.py                 # 100,000 sessions, 1M tokens
    .venv/bin/python benchmarks/console_scale.py --sessions 10000 --tokens 100000 --no-browser

Set-up: an embedded nats-server (a temp store), the console's index (a temp SQLite file) holding
``--sessions`` sessions of 50 tenants (bulk-inserted rows shaped as the feed writes them, a fifth
flagged), and one trajectory of ``--tokens`` ids (ChatML messages of the tiny model's tokenizer,
every other message sampled) published to the trajectories stream as the assembler does (over the
max payload: through the object store) and indexed by the console's own feed. The console is
served by uvicorn on a socket, as ``stream-gateway console`` serves it.

Timed, each the median of ``--repeat`` runs, over HTTP:

* the admin's first sessions page (50 rows, newest first, with the total count), the same for one
  tenant, and filtered by a health flag; beside each, the same SQL run directly on the index file
  (the baseline: what the HTTP layer adds is the ratio);
* the 1M-token trajectory's first tokens page, cold (read back from NATS and laid out) and warm,
  and a page in its middle;
* with Chromium (unless ``--no-browser``): from navigation to the trajectory view's 2,000 tokens
  on screen, and to the sessions page's rows on screen.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumers.streams import ConsumerStreams, ensure_consumer_streams  # noqa: E402
from pipeline.durable import publish_durable  # noqa: E402
from pipeline.embedded import EmbeddedNatsServer  # noqa: E402
from stream_gateway.control import KeyRing, Limits  # noqa: E402
from stream_gateway.models import resolve_model  # noqa: E402
from stream_stack.console import ConsoleApi, ConsoleIndex, Feed, Tokenizers, create_console_app  # noqa: E402

ADMIN = "sk-admin"
FLAGS = ["no-reward", "forked", "aborted", "truncated", "mixed-versions"]


def _sessions(count: int) -> list[tuple[Any, ...]]:
    rng = random.Random(7)
    now = time.time()
    rows = []
    for i in range(count):
        tenant = f"t{rng.randrange(50):015x}"
        flags = f" {rng.choice(FLAGS)} " if rng.random() < 0.2 else " "
        last = now - rng.uniform(0, 30 * 86400)
        rows.append((tenant, f"session-{i:07d}", "tiny", rng.choice(["pi", "openclaw", "claude-cli", None]),
                     last - 60, last, rng.randrange(1, 40), flags))  # fmt: skip
    return rows


def _trajectory(tokens: int, tokenizer: Any) -> dict[str, Any]:
    """A long agent chain: ChatML user and assistant messages until ``tokens`` ids."""
    rng = random.Random(3)
    start, end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    user, assistant = tokenizer.encode("user\n"), tokenizer.encode("assistant\n")
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    turns = []
    while len(ids) < tokens:
        head = [start, *user]
        body = [rng.randrange(100, 1900) for _ in range(rng.randrange(200, 2000))]
        prompt = [*head, *body, end, start, *assistant]
        ids += prompt
        mask += [0] * len(prompt)
        logprobs += [0.0] * len(prompt)
        out = [rng.randrange(100, 1900) for _ in range(rng.randrange(100, 1000))]
        turns.append({"turn_id": f"turn{len(turns)}", "start": len(ids), "length": len(out), "finish_reason": "stop",
                      "policy_version": len(turns) // 50, "policy_versions": [[len(turns) // 50, 0]]})  # fmt: skip
        ids += out
        mask += [1] * len(out)
        logprobs += [-rng.random() * 3 for _ in out]
        ids.append(end)
        mask.append(0)
        logprobs.append(0.0)
    return {
        "schema_version": 5, "trajectory_id": "trbig", "session_id": "session-big", "tenant": "tbig", "model": "tiny",
        "token_ids": ids, "loss_mask": mask, "logprobs": logprobs, "reasoning_mask": [0] * len(ids),
        "prompt_length": turns[0]["start"], "turns": turns, "num_turns": len(turns), "min_policy_version": 0,
        "max_policy_version": turns[-1]["policy_version"], "reward": 1.0, "reward_source": "feedback",
        "emitted_because": "closed", "started_at": time.time() - 3600, "ended_at": time.time(), "health": [],
    }  # fmt: skip


def _median_ms(call: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def _publish(url: str, data: dict[str, Any]) -> None:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    names = ConsumerStreams()
    await ensure_consumer_streams(js, names)
    payload = orjson.dumps(data)
    print(f"trajectory: {len(data['token_ids']):,} tokens, {len(payload) / 1e6:.1f} MB of JSON", flush=True)
    await publish_durable(nc, js, f"sg.trajectories.{data['tenant']}.{data['session_id']}", data["trajectory_id"],
                          payload, bucket=names.payload_bucket)  # fmt: skip
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tiny = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats_server:
        path = Path(tmp) / "console.sqlite"
        index = ConsoleIndex(path)
        started = time.perf_counter()
        index.insert_sessions(_sessions(args.sessions))
        print(f"index: {args.sessions:,} sessions inserted in {time.perf_counter() - started:.1f} s", flush=True)
        asyncio.run(_publish(nats_server.url, _trajectory(args.tokens, tokenizer)))
        _serve_and_measure(args, index, path, nats_server.url, tiny)


def _serve_and_measure(args: argparse.Namespace, index: ConsoleIndex, path: Path, url: str, tiny: str) -> None:
    import anyio

    from pipeline.connection import NatsAuth, connect

    port_holder: dict[str, Any] = {}

    async def serve() -> None:
        nc = await connect((url,), NatsAuth(), name="console-bench")
        feed = Feed(nc, index, ConsumerStreams())
        api = ConsoleApi(index, feed, Tokenizers({"tiny": tiny}), KeyRing((), None, Limits()), (ADMIN,))
        config = uvicorn.Config(create_console_app(api), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        port_holder["server"] = server
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)
            await server.serve()
            tg.cancel_scope.cancel()

    thread = threading.Thread(target=lambda: anyio.run(serve), daemon=True)
    thread.start()
    while "server" not in port_holder or not port_holder["server"].started:
        time.sleep(0.05)
    port = port_holder["server"].servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, timeout=120)
    http.post("/api/login", json={"key": ADMIN}).raise_for_status()
    deadline = time.monotonic() + 120
    while http.get("/api/sessions/session-big").status_code != 200:  # the feed indexes the trajectory
        assert time.monotonic() < deadline, "the trajectory was never indexed"
        time.sleep(0.2)
    raw = sqlite3.connect(str(path))
    tenant = raw.execute("SELECT tenant FROM sessions LIMIT 1").fetchone()[0]

    def sql(where: str, values: tuple[Any, ...]) -> None:
        raw.execute(
            f"SELECT * FROM sessions {where} ORDER BY last_at DESC, session_id DESC LIMIT 50", values
        ).fetchall()
        raw.execute(f"SELECT count(*) FROM sessions {where}", values).fetchone()

    rows = [
        ("first page, every tenant", {}, ("", ())),
        ("first page, one tenant", {"tenant": tenant}, ("WHERE tenant = ?", (tenant,))),
        ("first page, flag aborted", {"flag": "aborted"}, ("WHERE health LIKE ?", ("% aborted %",))),
    ]
    print(f"\n{'sessions (' + format(args.sessions, ',') + ' stored)':<34}{'HTTP ms':>10}{'SQL ms':>10}{'ratio':>8}")
    for name, params, (where, values) in rows:
        over_http = _median_ms(lambda p=params: http.get("/api/sessions", params=p).raise_for_status(), args.repeat)
        direct = _median_ms(lambda w=where, v=values: sql(w, v), args.repeat)
        print(f"{name:<34}{over_http:>10.1f}{direct:>10.1f}{over_http / direct:>8.1f}")
    started = time.perf_counter()
    first = http.get("/api/trajectories/trbig/tokens", params={"offset": 0, "limit": 2000})
    first.raise_for_status()
    cold = (time.perf_counter() - started) * 1000
    length = first.json()["length"]
    warm = _median_ms(lambda: http.get("/api/trajectories/trbig/tokens", params={"limit": 2000}).raise_for_status(),
                      args.repeat)  # fmt: skip
    middle = _median_ms(lambda: http.get("/api/trajectories/trbig/tokens",
                                         params={"offset": length // 2, "limit": 2000}).raise_for_status(), args.repeat)  # fmt: skip
    print(f"\ntrajectory of {length:,} tokens, a page of 2,000")
    print(f"  first page, cold (read from NATS + laid out)   {cold:8.0f} ms")
    print(f"  first page, warm                               {warm:8.1f} ms")
    print(f"  page at the middle, warm                       {middle:8.1f} ms")
    if not args.no_browser:
        _browser(base, args.repeat)


def _browser(base: str, repeat: int) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
        )
        page = browser.new_context().new_page()
        page.goto(base + "/")
        page.fill("#key", ADMIN)
        page.click("#signin button[type=submit]")
        page.wait_for_selector("#sessions tr")

        def view(hash_: str, selector: str) -> None:
            page.goto(base + "/#/loop")
            page.wait_for_selector("#replicas, .dim")
            page.goto(base + "/" + hash_)
            page.wait_for_selector(selector)

        tokens = _median_ms(lambda: view("#/trajectory/trbig", "#tokens .tok >> nth=1999"), repeat)
        sessions = _median_ms(lambda: view("#/sessions", "#sessions tr >> nth=49"), repeat)
        browser.close()
    print("\nChromium, navigation to content on screen")
    print(f"  trajectory view, 2,000 tokens                  {tokens:8.0f} ms")
    print(f"  sessions view, 50 rows                         {sessions:8.0f} ms")


if __name__ == "__main__":
    main()
