"""Gateway throughput and time to first token, side by side with plain Hugging Face ``generate``.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/gateway_throughput.py --model tiny
    .venv/bin/python benchmarks/gateway_throughput.py --model smollm2 --tokens 64

What is measured, in one run on one machine:

* baseline 1: ``model.generate`` on one prompt (sampling, ``min_new_tokens`` = ``max_new_tokens`` so
  every run decodes the same number of tokens): tokens/s.
* baseline 8: ``model.generate`` on 8 left-padded prompts at once: total tokens/s.
* gateway 1 / gateway 8: ``stream-gateway serve`` (transformers engine) in a subprocess, 1 or 8
  concurrent streaming requests over HTTP with ``ignore_eos``; tokens/s counted from the streamed
  ``token_ids`` as the client receives them, so SSE, HTTP and client parsing are included.
* time to first token: request sent to first content chunk received, median over sequential
  requests, next to the baseline's time for a prefill plus one decode step on the same prompt.

The baseline gets the same torch thread count as the engine chooses for the model. Results are
ratios against the baselines; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.model_store import resolve_model

PROMPTS = [f"Tell story number {i} about a lighthouse keeper and the sea." for i in range(8)]


def _threads_for(model: AutoModelForCausalLM) -> int:
    # Mirror the transformers engine's choice so both sides use the same intra-op threads.
    return 1 if getattr(model.config, "hidden_size", 0) < 256 else torch.get_num_threads()


def baseline(path: str, tokens: int, repeats: int) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.set_num_threads(_threads_for(model))
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    single = tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = {
        "do_sample": True,
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
        "pad_token_id": tokenizer.pad_token_id,
    }

    def rate(inputs: dict[str, torch.Tensor], n: int) -> float:
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(**inputs, **kwargs)
            best = max(best, n * tokens / (time.perf_counter() - start))
        return best

    rate(single, 1)  # warm-up
    first = []
    for _ in range(5):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**single, do_sample=True, max_new_tokens=1, pad_token_id=tokenizer.pad_token_id)
        first.append(time.perf_counter() - start)
    return {
        "tokens_per_s_1": rate(single, 1),
        "tokens_per_s_8": rate(batch, 8),
        "first_token_s": statistics.median(first),
        "threads": float(torch.get_num_threads()),
    }


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> tuple[int, float, float]:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = 0.0
    count = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                ids = choice.get("token_ids") or []
                if ids and not first:
                    first = time.perf_counter() - start
                count += len(ids)
    return count, first, time.perf_counter() - start


async def gateway(base_url: str, tokens: int, repeats: int) -> dict[str, float]:
    url = base_url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, PROMPTS[0], 8)  # warm-up

        async def rate(n: int) -> float:
            best = 0.0
            for _ in range(repeats):
                start = time.perf_counter()
                results = await asyncio.gather(*(_stream(client, url, PROMPTS[i], tokens) for i in range(n)))
                best = max(best, sum(r[0] for r in results) / (time.perf_counter() - start))
            return best

        one = await rate(1)
        eight = await rate(8)
        ttft = [(await _stream(client, url, PROMPTS[0], 2))[1] for _ in range(10)]
    return {"tokens_per_s_1": one, "tokens_per_s_8": eight, "first_token_s": statistics.median(ttft)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=3, help="best of N for throughput")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    path = resolve_model(args.model)

    print(f"baseline: transformers generate on {args.model} ...", file=sys.stderr)
    base = baseline(path, args.tokens, args.repeats)

    port = _free_port()
    command = [
        sys.executable, "-m", "stream_gateway.cli", "serve", "--model", path, "--served-model-name", "bench",
        "--port", str(port), "--log-level", "warning", "--max-batch-size", "8",
    ]  # fmt: skip
    print(f"gateway: {' '.join(command[2:])} ...", file=sys.stderr)
    server = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the gateway did not start") from None
                time.sleep(0.2)
        gw = asyncio.run(gateway(f"http://127.0.0.1:{port}", args.tokens, args.repeats))
    finally:
        server.terminate()
        server.wait(timeout=60)

    rows = [
        ("1 stream, tokens/s", base["tokens_per_s_1"], gw["tokens_per_s_1"]),
        ("8 streams, tokens/s (baseline: generate batch of 8)", base["tokens_per_s_8"], gw["tokens_per_s_8"]),
        ("time to first token, ms", base["first_token_s"] * 1000, gw["first_token_s"] * 1000),
    ]
    print(f"\nmodel {args.model}, {args.tokens} tokens per stream, torch threads {int(base['threads'])}")
    print(f"{'':52} {'HF generate':>12} {'gateway':>10} {'ratio':>7}")
    for name, b, g in rows:
        print(f"{name:52} {b:12.1f} {g:10.1f} {g / b:7.2f}")
    for name, ratio in (
        ("8 streams vs 1 stream through the gateway", gw["tokens_per_s_8"] / gw["tokens_per_s_1"]),
        ("gateway 8 streams vs HF generate 1 stream", gw["tokens_per_s_8"] / base["tokens_per_s_1"]),
    ):
        print(f"{name:52} {'':12} {'':10} {ratio:7.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "tokens": args.tokens, "baseline": base, "gateway": gw}, indent=2)
        )


if __name__ == "__main__":
    main()
