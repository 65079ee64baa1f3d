"""Gateway throughput and time to first token, side by side with plain Hugging Face ``generate``.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/gateway_throughput.py --model tiny
    .venv/bin/python benchmarks/gateway_throughput.py --model smollm2 --tokens 64

What is measured, in one run on one machine:

* baseline 1: ``model.generate`` on one prompt (sampling, ``min_new_tokens`` = ``max_new_tokens`` so
  every run decodes the same number of tokens): tokens/s.
* baseline 8: ``model.generate`` on 8 left-padded prompts at once: total tokens/s.
* gateway 1 / gateway 8: ``stream-gateway serve`` (transformers engine) in a subprocess, 1 or 8
  concurrent streaming requests over HTTP with ``ignore_eos``, sent by ``benchmarks/loadgen.py`` in
  a process of its own (raw sockets, a fraction of the gateway's CPU per token); tokens/s from the
  usage the server reports, over the time from the first request sent to the last response ended,
  so SSE and HTTP are included.
* time to first token: request sent to first content chunk received, median over 10 sequential
  requests, next to the baseline's time for a prefill plus one decode step on the same prompt.

The baseline gets the same torch thread count as the engine chooses for the model. Results are
ratios against the baselines; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _procs import loadgen
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.models import resolve_model

PROMPTS = [f"Tell story number {i} about a lighthouse keeper and the sea." for i in range(8)]


def _threads_for(model: AutoModelForCausalLM) -> int:
    # Mirror the transformers engine's choice so both sides use the same intra-op threads.
    return 1 if getattr(model.config, "hidden_size", 0) < 256 else torch.get_num_threads()


class Baseline:
    """Plain ``model.generate`` on the same model and prompts, in this process."""

    def __init__(self, path: str, tokens: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        torch.set_num_threads(_threads_for(self.model))
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        self.single = self.tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False)
        self.batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.tokens = tokens
        self.kwargs = {
            "do_sample": True,
            "max_new_tokens": tokens,
            "min_new_tokens": tokens,
            "pad_token_id": self.tokenizer.pad_token_id,
        }

    def rate(self, n: int) -> float:
        inputs = self.single if n == 1 else self.batch
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(**inputs, **self.kwargs)
        return n * self.tokens / (time.perf_counter() - start)

    def first_token_s(self) -> float:
        times = []
        for _ in range(10):
            start = time.perf_counter()
            with torch.inference_mode():
                self.model.generate(
                    **self.single, do_sample=True, max_new_tokens=1, pad_token_id=self.kwargs["pad_token_id"]
                )
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def measure(base: Baseline, url: str, tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Baseline and gateway runs alternated within every repeat (drift and neighbours hit both alike)."""
    runs: dict[str, dict[str, list[float]]] = {"baseline": {}, "gateway": {}}
    base.rate(1)  # warm-up
    loadgen(url, "bench", 1, 8)
    for repeat in range(repeats):
        for n in (1, 8):
            pair = [
                ("baseline", lambda n=n: base.rate(n)),
                ("gateway", lambda n=n: loadgen(url, "bench", n, tokens)["tokens_per_s"]),
            ]
            for name, run in pair if repeat % 2 == 0 else pair[::-1]:
                runs[name].setdefault(str(n), []).append(run())
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    runs["baseline"]["first_token_s"] = [base.first_token_s()]
    runs["gateway"]["first_token_s"] = [loadgen(url, "bench", 1, 2, requests=10)["first_token"]["p50_ms"] / 1000]
    return runs


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
    base = Baseline(path, args.tokens)

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
        runs = measure(base, f"http://127.0.0.1:{port}", args.tokens, args.repeats)
    finally:
        server.terminate()
        server.wait(timeout=60)

    med = {side: {k: statistics.median(v) for k, v in r.items()} for side, r in runs.items()}
    b, gw = med["baseline"], med["gateway"]
    rows = [
        ("1 stream, tokens/s", b["1"], gw["1"]),
        ("8 streams, tokens/s (baseline: generate batch of 8)", b["8"], gw["8"]),
        ("time to first token, ms", b["first_token_s"] * 1000, gw["first_token_s"] * 1000),
    ]
    print(f"\nmodel {args.model}, {args.tokens} tokens per stream, torch threads {torch.get_num_threads()}, "
          f"medians of {args.repeats} alternated runs")  # fmt: skip
    print(f"{'':52} {'HF generate':>12} {'gateway':>10} {'ratio':>7}")
    for name, base_value, gateway_value in rows:
        print(f"{name:52} {base_value:12.1f} {gateway_value:10.1f} {gateway_value / base_value:7.2f}")
    ratios = [
        r["gateway"] / r["baseline"]
        for r in (
            {"gateway": g, "baseline": x} for g, x in zip(runs["gateway"]["8"], runs["baseline"]["8"], strict=True)
        )
    ]
    print(f"{'8 streams, ratio per repeat':52} {'':12} {'':10} " + " ".join(f"{r:.2f}" for r in ratios))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
