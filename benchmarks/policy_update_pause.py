"""What a published weight update costs the streams in flight: inter-token gaps with and without updates.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/policy_update_pause.py                      # tiny model
    .venv/bin/python benchmarks/policy_update_pause.py --model smollm2 --streams 4 --tokens 256

What is measured, in one run on one machine:

* one gateway, ``stream-gateway serve --model MODEL --nats-url ...`` in a subprocess, following
  policies on an embedded nats-server (JetStream, temp store), and a checkpoint of the model's
  own weights, perturbed (so every update really changes every tensor).
* rounds of ``--streams`` concurrent streaming requests (``ignore_eos``, ``max_tokens`` =
  ``--tokens``, temperature 1), alternating: a round without updates, then a round during which
  the checkpoint is published (``publish_policy``: upload, ``policy.updated``) ``--updates`` times
  at even intervals; ``--repeats`` pairs. The client records the arrival time of every SSE frame.
* the inter-token gap (time between consecutive frames of one stream): p50, p99 and max over every
  gap of every stream of all rounds of a kind, and their ratio with updates / without.
* the gateway's own account of each update (``policy.applied`` events): ``pause_s``, how long
  decoding stood still (the in-memory copy of the tensors + the KV-cache recompute of the requests
  in flight), ``copy_s`` (the copy alone), ``download_s`` (object store to local disk, digests
  checked: decoding goes on meanwhile) and ``in_flight``. p50/p99/max over all updates.
* streams that failed or ended early (must be 0), and every update applied (none rejected).

The client shares the machine, so absolute numbers depend on it; the ratios and the pause
against the download time are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import orjson

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import PolicyApplied, PolicyRejected, decode_event
from pipeline.policies import publish_policy
from stream_gateway.models import resolve_model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _checkpoint(model_dir: Path, out: Path) -> int:
    """The model's weights, perturbed, as one safetensors file; how many tensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    state = {k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return len(state)


async def _stream(client: httpx.AsyncClient, url: str, model: str, tokens: int, gaps: list[float]) -> bool:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    last: float | None = None
    frames = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return False
        # Bytes split on b"\n", not aiter_lines: str.splitlines() would also split inside JSON
        # strings at U+2028 and friends, which orjson leaves unescaped (and random text holds).
        pending = b""
        async for data in response.aiter_bytes():
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    return False
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    frames += 1
    return frames > 0


async def _round(
    url: str, model: str, streams: int, tokens: int, publish: Any | None, updates: int, expected_s: float
) -> tuple[list[float], int]:
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client, asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(_stream(client, url, model, tokens, gaps)) for _ in range(streams)]
        if publish is not None:
            for _ in range(updates):
                await asyncio.sleep(expected_s / (updates + 1))
                await publish()
    return gaps, sum(not task.result() for task in tasks)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="sg-pause-") as tmp, EmbeddedNatsServer() as server:
        tensors = _checkpoint(Path(model_dir), Path(tmp) / "ckpt")
        port = _free_port()
        command = [
            sys.executable, "-m", "stream_gateway.cli", "serve", "--model", args.model, "--served-model-name", "m",
            "--port", str(port), "--nats-url", server.url, "--outbox-dir", str(Path(tmp) / "outbox"),
            "--replica-id", "bench", "--log-level", "warning",
        ]  # fmt: skip
        gateway = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(1200):
                    try:
                        if (await client.get(url + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
            nc = await nats.connect(server.url)
            version = 0

            async def publish() -> None:
                nonlocal version
                version += 1
                await publish_policy(nc, Path(tmp) / "ckpt", version, keep_full=1)

            # A warm-up round also tells how long a round takes, to spread the updates over it.
            started = time.perf_counter()
            await _round(url, "m", args.streams, args.tokens, None, 0, 0.0)
            expected_s = time.perf_counter() - started
            without: list[float] = []
            during: list[float] = []
            failed = 0
            for _ in range(args.repeats):
                gaps, bad = await _round(url, "m", args.streams, args.tokens, None, 0, expected_s)
                without += gaps
                failed += bad
                gaps, bad = await _round(url, "m", args.streams, args.tokens, publish, args.updates, expected_s)
                during += gaps
                failed += bad
            await asyncio.sleep(2.0)  # let the last update land
            applied, rejected = await _policy_events(nc)
            await nc.close()
        finally:
            gateway.terminate()
            gateway.wait(timeout=60)
    return {
        "model": args.model,
        "tensors": tensors,
        "published": version,
        "applied": applied,
        "rejected": rejected,
        "without": without,
        "during": during,
        "failed": failed,
    }


async def _policy_events(nc: Any) -> tuple[list[PolicyApplied], int]:
    js = nc.jetstream()
    subscription = await js.subscribe("sg.events._._.policy.*", ordered_consumer=True)
    applied: list[PolicyApplied] = []
    rejected = 0
    try:
        while True:
            msg = await subscription.next_msg(timeout=1.0)
            event = decode_event(msg.data)
            if isinstance(event, PolicyApplied):
                applied.append(event)
            elif isinstance(event, PolicyRejected):
                rejected += 1
    except nats.errors.TimeoutError:
        pass
    finally:
        await subscription.unsubscribe()
    return applied, rejected


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    without, during, applied = result["without"], result["during"], result["applied"]
    print(f"model {result['model']} ({result['tensors']} tensors), {args.streams} streams x {args.tokens} tokens, "
          f"{args.repeats} repeats, {args.updates} updates per round, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'inter-token gap':<28}{'without updates':>18}{'during updates':>18}{'ratio':>8}")
    for label, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        a, b = _percentile(without, q), _percentile(during, q)
        print(f"  {label:<26}{a * 1e3:>15.2f} ms{b * 1e3:>15.2f} ms{b / a:>8.2f}")
    print(f"  {'mean':<26}{statistics.mean(without) * 1e3:>15.2f} ms{statistics.mean(during) * 1e3:>15.2f} ms")
    print(f"updates: {result['published']} published, {len(applied)} applied, {result['rejected']} rejected; "
          f"streams failed: {result['failed']}")  # fmt: skip
    for name in ("pause_s", "copy_s", "download_s"):
        values = [getattr(e, name) for e in applied]
        p50, p99 = _percentile(values, 0.5) * 1e3, _percentile(values, 0.99) * 1e3
        worst = max(values, default=float("nan")) * 1e3
        print(f"  {name:<12} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms   max {worst:8.2f} ms")
    print(f"  in flight per update: {[e.in_flight for e in applied]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, or a local model directory")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams per round (default 4)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per stream (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of rounds (default 3)")
    parser.add_argument("--updates", type=int, default=3, help="updates published per round with updates (default 3)")
    args = parser.parse_args()
    report(asyncio.run(measure(args)), args)


if __name__ == "__main__":
    main()
