"""LoRA adapters on one shared base (docs/adapters.md): tenants bound to adapters by their key,
served in one batch with the base, each turn recorded with its adapter and exactly the logprobs
of base + that adapter (PEFT, an independent implementation, computes the reference)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import peft
import pytest
import torch
from openai import NotFoundError, OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta", "sk-base": None}  # key -> the adapter its tenant is bound to
CONFIGS = {
    "alpha": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "beta": {
        "r": 8,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj"],
        "use_rslora": True,
    },
}


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two PEFT adapters of tiny, their lora_B drawn at random (PEFT starts it at zero: no change)."""
    out = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, config) in enumerate(CONFIGS.items()):
        model = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), peft.LoraConfig(**config)
        )
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        model.save_pretrained(out / name)
        dirs[name] = out / name
    return dirs


@pytest.fixture(scope="module")
def lora_gateway(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(
        "".join(
            f"{key} tenant-{adapter or 'base'}" + (f" adapter={adapter}" if adapter else "") + "\n"
            for key, adapter in KEYS.items()
        )
    )
    settings = Settings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        lora=tuple(f"{name}={path}" for name, path in adapters.items()),
        api_key_file=key_file,
        max_batch_size=8,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _reference(tiny_model_path: Path, adapters: dict[str, Path], adapter: str | None) -> Any:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapters[adapter]).eval()


def _turns(gateway: RunningGateway, key: str, session: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": f"Bearer {key}"})
    response.raise_for_status()
    turns: list[dict[str, Any]] = response.json()["turns"]
    return turns


def test_tenants_bound_to_adapters_share_a_batch_with_the_base(
    lora_gateway: RunningGateway, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    """Three tenants at once (two adapters, the base), streamed and whole: each turn's logprobs
    are base + its tenant's adapter's, whatever model name the client sent."""

    def converse(key: str, stream: bool) -> tuple[str, str]:
        session = f"lora{secrets.token_hex(4)}"
        with OpenAI(base_url=f"{lora_gateway.base_url}/sessions/{session}/v1", api_key=key, max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
            for follow_up in ("More.", None):
                # "tiny" for every tenant: the key's binding picks the adapter, not the client.
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=24, temperature=1.0, stream=stream
                )
                text = (
                    "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
                    if stream
                    else (
                        reply.choices[0].message.content or ""  # type: ignore[union-attr]
                    )
                )
                messages.append({"role": "assistant", "content": text})
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        return key, session

    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda args: converse(*args), [(k, s) for k in KEYS for s in (True, False)]))
    references = {adapter: _reference(tiny_model_path, adapters, adapter) for adapter in set(KEYS.values())}
    for key, session in runs:
        turns = _turns(lora_gateway, key, session)
        assert len(turns) == 2 and turns[1]["parent_id"] == turns[0]["turn_id"]  # one chain per conversation
        for turn in turns:
            assert turn["adapter"] == KEYS[key]
            ids = turn["prompt_ids"] + turn["output_ids"]
            with torch.no_grad():
                logits = references[KEYS[key]](input_ids=torch.tensor([ids])).logits[
                    0, len(turn["prompt_ids"]) - 1 : -1
                ]
            expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(turn["output_ids"])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(turn["logprobs"]), expected, atol=2e-4, rtol=0)
    # The adapters really differ from the base: the same ids score differently under each.
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        outs = [references[a](input_ids=ids).logits for a in (None, "alpha", "beta")]
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2


def test_an_adapter_is_its_tenants_alone(lora_gateway: RunningGateway) -> None:
    base = lora_gateway.base_url
    with OpenAI(base_url=f"{base}/v1", api_key="sk-base", max_retries=0) as client:
        with pytest.raises(NotFoundError):  # bound to another tenant: as if it did not exist
            client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert [m.id for m in client.models.list()] == ["tiny"]
        with pytest.raises(NotFoundError):
            client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with OpenAI(base_url=f"{base}/v1", api_key="sk-alpha", max_retries=0) as client:
        listed = {m.id: m.model_extra for m in client.models.list()}
        assert set(listed) == {"tiny", "alpha"} and listed["alpha"]["parent"] == "tiny"  # type: ignore[index]
        # Naming another adapter changes nothing: the key is bound to alpha.
    response = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"authorization": "Bearer sk-alpha"},
        json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert response.status_code == 200, response.text
    [turn] = _turns(lora_gateway, "sk-alpha", response.headers["x-session-id"])
    assert turn["adapter"] == "alpha"
