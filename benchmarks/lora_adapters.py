"""LoRA adapters in the batch: tokens/s and CPU per token with 0, 1 and 4 adapters among the rows,
against the base alone (no adapter bank at all), side by side in one run.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/lora_adapters.py                      # smollm2 (135M), 8 rows
    .venv/bin/python benchmarks/lora_adapters.py --model tiny --rows 16 --tokens 256 --repeats 5

The transformers engine in this process (``stream_gateway.engines.transformers``), one worker
thread, ``--rows`` requests decoding together (``ignore_eos``, ``--tokens`` each). Adapters are
PEFT LoRA adapters (rank ``--rank`` on q/k/v/o and the MLP projections) made here with seeded
random weights; they load through ``--lora`` as a gateway loads them. Configurations:

* ``base alone``: no adapter bank (an engine started without ``--lora``);
* ``0 adapters``: four adapters loaded, every row on the base (the hooks' idle cost);
* ``1 adapter``: half the rows on one adapter;
* ``4 adapters``: the rows spread over four adapters and the base.

Configurations alternate within every repeat; reported are medians over repeats of tokens/s and
of the process's CPU seconds per 1,000 tokens, and their ratios to ``base alone``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stream_gateway.engines import SamplingParams
from stream_gateway.engines.transformers import TransformersEngine
from stream_gateway.models import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: str, count: int, rank: int, folder: Path) -> dict[str, str]:
    import peft
    from transformers import AutoModelForCausalLM

    dirs = {}
    for i in range(count):
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        model.save_pretrained(folder / f"a{i}")
        dirs[f"a{i}"] = str(folder / f"a{i}")
    return dirs


async def one_run(engine: TransformersEngine, rows: list[str | None], tokens: int) -> dict[str, float]:
    async def request(i: int, adapter: str | None) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, adapter=adapter)
        count = 0
        async for step in engine.generate(f"r{i}", [1 + i, 2, 3, 4, 5, 6, 7, 8], params):
            count += len(step.token_ids)
        return count

    cpu, wall = time.process_time(), time.perf_counter()
    counts = await asyncio.gather(*(request(i, a) for i, a in enumerate(rows)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    total = sum(counts)
    return {"tokens": total, "tokens_per_s": total / wall, "cpu_per_1k": cpu / total * 1000}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(path, 4, args.rank, Path(tmp))
        names = list(adapters)
        rows = args.rows
        layouts: dict[str, list[str | None]] = {
            "0 adapters": [None] * rows,
            "1 adapter": [names[0] if i % 2 else None for i in range(rows)],
            "4 adapters": [names[i % 5 - 1] if i % 5 else None for i in range(rows)],
        }
        plain = TransformersEngine(path, max_batch_size=rows, num_threads=args.threads)
        banked = TransformersEngine(path, max_batch_size=rows, num_threads=args.threads, loras=adapters)
        results: dict[str, list[dict[str, float]]] = {"base alone": [], **{name: [] for name in layouts}}
        async with plain, banked:
            await one_run(plain, [None] * rows, 8)  # warm-up
            await one_run(banked, layouts["4 adapters"], 8)
            for repeat in range(args.repeats):
                order = [("base alone", plain, [None] * rows)] + [(n, banked, r) for n, r in layouts.items()]
                order = order[repeat % len(order) :] + order[: repeat % len(order)]
                for name, engine, layout in order:
                    run = await one_run(engine, layout, args.tokens)
                    results[name].append(run)
                    print(
                        f"[{repeat + 1}/{args.repeats}] {name:11} {run['tokens_per_s']:8.0f} tok/s "
                        f"{run['cpu_per_1k']:.3f} CPU-s/1k",
                        file=sys.stderr,
                        flush=True,
                    )
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in ("tokens_per_s", "cpu_per_1k")}
        for name, runs in results.items()
    }
    return {"model": args.model, "rows": args.rows, "tokens": args.tokens, "rank": args.rank, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=8, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    summary = result["summary"]
    base = summary["base alone"]
    print(f"\n{args.model}, {args.rows} rows x {args.tokens} tokens, rank {args.rank}, medians of {args.repeats}")
    print(f"{'configuration':12} {'tok/s':>8} {'CPU-s/1k':>9} {'tok/s ratio':>12} {'CPU ratio':>10}")
    for name, row in summary.items():
        print(
            f"{name:12} {row['tokens_per_s']:8.0f} {row['cpu_per_1k']:9.3f} "
            f"{row['tokens_per_s'] / base['tokens_per_s']:12.3f} {row['cpu_per_1k'] / base['cpu_per_1k']:10.3f}"
        )
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
