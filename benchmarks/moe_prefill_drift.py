"""How often a re-prefill routes a position differently from the decode step that first ran it,
and what that does to logprobs under replay.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/moe_prefill_drift.py
    .venv/bin/python benchmarks/moe_prefill_drift.py --sequences 16 --tokens 256 --json drift.json

A turn's routes are recorded as its tokens decode (one position per step, attending to a KV
cache); the next turn's prefill runs those positions again in one pass. The two passes compute
the same function in a different order, so a router whose top-k is nearly tied can pick
differently. docs/moe.md keeps the decode-time route (the one the sampled logprob came from);
this measures why. For each dtype and router spread, per sequence: sample ``--tokens`` tokens
with a KV cache capturing each step's routes, then run one prefill over the whole sequence and
compare:

* routes: the share of (position, layer) rows whose expert set differs;
* logprobs of the sampled tokens, against the ones recorded while decoding: the prefill with
  free routing, and the prefill with the decode-time routes replayed
  (``stream_gateway.moe.replay_routes``); max and mean absolute difference.

Models: ``tiny-moe`` as built (routers drawn wide: decisive routing), and the same weights with
the routers scaled down 50x (gaps like an undecided router's), each in float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stream_gateway.models import resolve_model
from stream_gateway.moe import RouterCapture, replay_routes


def _model(path: str, dtype: torch.dtype, router_scale: float) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(router_scale)
    return model


def _one(model: Any, capture: RouterCapture, prompt: list[int], tokens: int, seed: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    ids = list(prompt)
    decoded_routes, recorded = [], []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
        decoded_routes.append(capture.take()[0])
        for _ in range(tokens):
            logprobs = torch.log_softmax(logits.float(), -1)
            token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
            recorded.append(float(logprobs[token]))
            ids.append(token)
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
            decoded_routes.append(capture.take()[0])
        routes = np.concatenate(decoded_routes)[: len(ids) - 1]  # the last step's row is the unsampled token's
        inputs = torch.tensor([ids[:-1]])
        free_logits = model(input_ids=inputs).logits[0]
        prefill_routes = capture.take()[0]
        with replay_routes(model, routes):
            replayed_logits = model(input_ids=inputs).logits[0]
        capture.discard()
    targets = torch.tensor(ids[len(prompt) :])
    start = len(prompt) - 1
    reference = torch.tensor(recorded)

    def drift(logits: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits[start:].float(), -1).gather(1, targets[:, None])[:, 0]
        return (lp - reference).abs()

    differ = (np.sort(prefill_routes, -1) != np.sort(routes, -1)).any(-1)
    free, replayed = drift(free_logits), drift(replayed_logits)
    return {
        "rows_differ": float(differ.mean()),
        "free_max": float(free.max()),
        "free_mean": float(free.mean()),
        "replayed_max": float(replayed.max()),
        "replayed_mean": float(replayed.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per sequence")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model("tiny-moe")
    rows = []
    for scale, label in ((1.0, "as built (decisive)"), (0.02, "routers / 50 (undecided)")):
        for dtype in (torch.float32, torch.bfloat16):
            model = _model(path, dtype, scale)
            capture = RouterCapture.attach(model)
            assert capture is not None
            results = [
                _one(model, capture, [1 + (7 * s + i) % 1900 for i in range(24)], args.tokens, seed=s)
                for s in range(args.sequences)
            ]
            capture.detach()
            row = {"routers": label, "dtype": str(dtype).removeprefix("torch.")}
            for key in results[0]:
                values = [r[key] for r in results]
                averaged = key.endswith("mean") or key == "rows_differ"
                row[key] = statistics.mean(values) if averaged else max(values)
            rows.append(row)
            print(
                f"{label:26} {row['dtype']:9} rows differing {row['rows_differ']:8.4%}  "
                f"|dlogprob| free max {row['free_max']:.2e} mean {row['free_mean']:.2e}  "
                f"replayed max {row['replayed_max']:.2e} mean {row['replayed_mean']:.2e}",
                flush=True,
            )
    if args.json:
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
