"""A weight update under load, at the engine: the decode pause it causes and the exactness it keeps.

Run (CPU, or any CUDA machine with torch and transformers; no gateway, no NATS)::

    .venv/bin/python benchmarks/engine_swap_pause.py                              # tiny model, CPU
    python3 benchmarks/engine_swap_pause.py --shape smollm2 --device cuda --rows 16 --tokens 1024

What is measured, in one run:

* a ``TransformersEngine`` serving the tiny model, or (``--shape smollm2``) a randomly initialised
  model of SmolLM2-135M's shape (30 layers, hidden 576: 135M parameters; built from its config
  with the tiny model's tokenizer, so nothing is downloaded);
* ``--rows`` concurrent requests of ``--tokens`` tokens (temperature 1, ignore EOS) with prompts
  of different lengths; once all are decoding, ``--updates`` weight updates (every tensor
  perturbed) are applied one after another while they keep decoding;
* for each update, the engine's own report: ``copy_s`` (the in-memory copy of every tensor) and
  ``pause_s`` (copy + the KV recompute of every row in flight: how long decoding stood still);
  the inter-step gap of the rows with and without an update in it (p50, max);
* exactness: every token's recorded logprob against a forward pass, over the whole sequence, of
  the weights of the version that sampled it (max absolute difference per version).

Where ``stream_gateway`` is importable without its HTTP dependencies (a bare GPU machine with
only torch and transformers), the engine package is loaded on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _engine_module() -> Any:
    try:
        from stream_gateway.engines import transformers as module
    except ImportError:  # no fastapi/pydantic-settings here: load the engines package alone
        package = types.ModuleType("stream_gateway")
        package.__path__ = [str(ROOT / "stream_gateway")]
        sys.modules["stream_gateway"] = package
        from stream_gateway.engines import transformers as module
    return module


def _build(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if shape == "tiny":
        return tokenizer_dir
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def _run(args: argparse.Namespace, model_dir: Path) -> None:
    module = _engine_module()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    states = {0: {k: v.detach().clone() for k, v in reference.state_dict().items()}}
    generator = torch.Generator().manual_seed(1)
    for version in range(1, args.updates + 1):
        states[version] = {
            k: v + 0.02 * v.std().nan_to_num() * torch.randn(v.shape, generator=generator).to(v.device)
            for k, v in states[version - 1].items()
        }
    if reference.config.tie_word_embeddings:
        for state in states.values():
            state.pop("lm_head.weight", None)
    params_m = sum(v.numel() for v in states[0].values()) / 1e6
    engine = module.TransformersEngine(
        model_dir, max_batch_size=args.rows, device=args.device, recompute_on_update=not args.keep_cache
    )
    from stream_gateway.engines import SamplingParams

    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=11, ignore_eos=True)
    prompts = [[5 + i % 50] * (16 + 37 * i) for i in range(args.rows)]
    steps: dict[int, list[Any]] = {i: [] for i in range(args.rows)}
    arrivals: dict[int, list[float]] = {i: [] for i in range(args.rows)}
    reports = []
    async with engine:
        decoding = asyncio.Event()

        async def run(i: int) -> None:
            async for step in engine.generate(f"r{i}", prompts[i], params):
                steps[i].append(step)
                arrivals[i].append(time.perf_counter())
                if all(len(s) >= 8 for s in steps.values()):
                    decoding.set()

        async with asyncio.TaskGroup() as tg:  # the rows; leaving it waits for all of them
            for i in range(args.rows):
                tg.create_task(run(i))
            await decoding.wait()
            for version in range(1, args.updates + 1):
                await asyncio.sleep(0.2)
                windows_start = time.perf_counter()
                report = await engine.update_weights(states[version], version)
                reports.append((windows_start, time.perf_counter(), report))

    mode = "keep" if args.keep_cache else "recompute"
    print(f"model {args.shape} ({params_m:.1f}M parameters), KV cache on update: {mode}, on {args.device} "
          f"({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}), "
          f"{args.rows} rows x {args.tokens} tokens, prompts {len(prompts[0])}-{len(prompts[-1])} tokens")  # fmt: skip
    for _, _, report in reports:
        print(f"  update v{report.previous_version}->v{report.policy_version}: {report.tensors} tensors, "
              f"copy {report.copy_s * 1e3:.2f} ms, pause {report.pause_s * 1e3:.2f} ms, "
              f"{report.in_flight} rows in flight")  # fmt: skip
    quiet, around = [], []
    for times in arrivals.values():
        for a, b in itertools.pairwise(times):
            hit = any(a <= end and b >= start for start, end, _ in reports)
            (around if hit else quiet).append(b - a)
    print(f"  inter-step gap without an update: p50 {statistics.median(quiet) * 1e3:.2f} ms, "
          f"max {max(quiet) * 1e3:.2f} ms; spanning an update: p50 {statistics.median(around) * 1e3:.2f} ms, "
          f"max {max(around) * 1e3:.2f} ms")  # fmt: skip
    # Exactness: each token against a forward pass of its own version's weights.
    worst: dict[int, float] = {}
    counts: dict[int, int] = {}
    with torch.inference_mode():
        for version, state in states.items():
            reference.load_state_dict(state, strict=False)
            for i, prompt in enumerate(prompts):
                output = [s.token_ids[0] for s in steps[i]]
                own = torch.tensor([s.policy_version == version for s in steps[i]])
                if not own.any():
                    continue
                ids = torch.tensor([prompt + output], device=args.device)
                logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                predicted = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()
                recorded = torch.tensor([s.logprobs[0] for s in steps[i]])
                diff = (predicted[own] - recorded[own]).abs().max().item()
                worst[version] = max(worst.get(version, 0.0), diff)
                counts[version] = counts.get(version, 0) + int(own.sum())
    rows_ok = all(len(s) == args.tokens for s in steps.values())
    print(f"  every row finished all {args.tokens} tokens: {rows_ok}")
    for version in sorted(worst):
        print(f"  version {version}: {counts[version]} tokens, max |recorded - forward pass| = {worst[version]:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--tokenizer", help="a model directory to take the tokenizer from (default: the tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--keep-cache", action="store_true", help="--kv-cache-on-update keep: no recompute")
    args = parser.parse_args()
    if args.tokenizer:
        tokenizer_dir = Path(args.tokenizer)
    else:
        from stream_gateway.models import build_tiny_model

        tokenizer_dir = build_tiny_model()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the exactness check compares against it
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="sg-swap-") as tmp:
        model_dir = _build(args.shape, tokenizer_dir, Path(tmp))
        asyncio.run(_run(args, model_dir))


if __name__ == "__main__":
    main()
