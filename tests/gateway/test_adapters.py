"""LoRA adapters on one shared base (docs/adapters.md): tenants bound to adapters by their key,
served in one batch with the base, each turn recorded with its adapter and exactly the logprobs
of base + that adapter (PEFT, an independent implementation, computes the reference)."""

from __future__ import annotations

import secrets
import threading
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

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.lora import make_adapter, mis_shaped
from ..support.servers import RunningGateway, run_gateway, scripted_settings

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
    return {
        name: make_adapter(tiny_model_path, config, seed, out / name)
        for seed, (name, config) in enumerate(CONFIGS.items())
    }


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
        admin_api_keys=("sk-admin",),
        max_batch_size=8,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _reference(tiny_model_path: Path, adapters: dict[str, Path], adapter: str | None) -> Any:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapters[adapter]).eval()


def _logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]


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


def test_a_new_version_of_one_adapter_changes_its_rows_mid_stream_and_no_others(
    lora_gateway: RunningGateway, tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """alpha@0 -> alpha@1 while three streams run: alpha's turn is labelled with both versions,
    each token scored by its own version; beta's and the base's stay exactly as before."""
    new_alpha = make_adapter(tiny_model_path, CONFIGS["alpha"], 7, tmp_path / "alpha-v1")
    started = threading.Barrier(4)
    sessions: dict[str, str] = {}

    def stream(key: str) -> None:
        session = sessions[key] = f"swap{secrets.token_hex(4)}"
        with OpenAI(base_url=f"{lora_gateway.base_url}/sessions/{session}/v1", api_key=key, max_retries=0) as client:
            chunks = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Go on and on."}],
                max_tokens=400,
                temperature=1.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i, _ in enumerate(chunks):
                if i == 2:
                    started.wait(timeout=60)

    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(stream, key) for key in KEYS]
        started.wait(timeout=60)  # every stream has tokens
        loaded = httpx.post(
            f"{lora_gateway.base_url}/policy/weights",
            headers={"authorization": "Bearer sk-admin"},
            json={"path": str(new_alpha), "policy_version": 1, "adapter": "alpha"},
            timeout=60,
        )
        for run in runs:
            run.result(timeout=120)
    assert loaded.status_code == 200 and loaded.json()["previous_version"] == 0, loaded.text
    models = {
        ("alpha", 0): _reference(tiny_model_path, adapters, "alpha"),
        ("alpha", 1): _reference(tiny_model_path, {"alpha": new_alpha}, "alpha"),
        ("beta", 0): _reference(tiny_model_path, adapters, "beta"),
        (None, 0): _reference(tiny_model_path, adapters, None),
    }
    for key, adapter in KEYS.items():
        [turn] = _turns(lora_gateway, key, sessions[key])
        spans = [tuple(span) for span in turn["policy_versions"]]
        assert len(turn["output_ids"]) == 400
        if adapter == "alpha":
            assert [v for v, _ in spans] == [0, 1], spans  # both versions of alpha sampled this turn
        else:
            assert spans == [(0, 0)], (adapter, spans)  # the others never saw the update
        bounds = [start for _, start in spans] + [400]
        recorded = torch.tensor(turn["logprobs"])
        for (version, start), end in zip(spans, bounds[1:], strict=True):
            expected = _logprobs(models[(adapter, version)], turn["prompt_ids"], turn["output_ids"])
            torch.testing.assert_close(recorded[start:end], expected[start:end], atol=2e-4, rtol=0)
    stale = httpx.post(
        f"{lora_gateway.base_url}/policy/weights",
        headers={"authorization": "Bearer sk-admin"},
        json={"path": str(new_alpha), "policy_version": 1, "adapter": "alpha"},
    )
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_policy_version"


def test_adapters_the_base_cannot_take_are_refused(
    lora_gateway: RunningGateway, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A rank/shape that does not fit the base, a missing directory, an unreadable one: a 4xx, and
    the adapters in service unchanged."""
    bad = mis_shaped(adapters["alpha"], tmp_path / "bad")
    empty = tmp_path / "empty"
    empty.mkdir()

    def post(path: Path, version: int = 9) -> httpx.Response:
        return httpx.post(
            f"{lora_gateway.base_url}/policy/weights",
            headers={"authorization": "Bearer sk-admin"},
            json={"path": str(path), "policy_version": version, "adapter": "alpha"},
        )

    for path, reason in ((bad, "shape_mismatch"), (empty, "unreadable"), (tmp_path / "nowhere", "No directory")):
        response = post(path)
        assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
    listed = httpx.get(f"{lora_gateway.base_url}/v1/models", headers={"authorization": "Bearer sk-alpha"}).json()
    assert {m["id"]: m.get("policy_version") for m in listed["data"]}["alpha"] in (0, 1)  # unchanged by the refusals


def test_a_tool_loop_on_an_adapter_is_one_exact_chain(agent_model_path: Path, tmp_path: Path) -> None:
    """tiny-agent's answers (the scripted engine on the untrained ``tiny``) with a small adapter
    bound to a tenant: the tool loop and its follow-up are one chain of turns recorded with the
    adapter, each logprob base + adapter's (PEFT's)."""
    adapter = make_adapter(agent_model_path, CONFIGS["alpha"], 3, tmp_path / "agent-alpha", scale=0.05)
    keys = tmp_path / "keys"
    keys.write_text("sk-agent tenant-agent adapter=alpha\n")
    settings = scripted_settings(agent_model_path, lora=(f"alpha={adapter}",), api_key_file=keys,
                                 default_temperature=0.0)  # fmt: skip
    (tmp_path / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"tools{secrets.token_hex(4)}"
    with run_gateway(build_engine(settings), settings) as gateway:
        with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="sk-agent", max_retries=0) as client:
            drive_session(
                client,
                "tiny-agent",
                [{"role": "user", "content": "What does the README say?"}],
                follow_ups=["Read it once more."],
                workdir=tmp_path,
                tools=[READ_TOOL],
                max_tokens=64,
            )
        turns = _turns(gateway, "sk-agent", session)
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop", "tool_calls", "stop"]
    assert sum(t["parent_id"] is None for t in turns) == 1 and all(t["adapter"] == "alpha" for t in turns)
    reference = _reference(agent_model_path, {"alpha": adapter}, "alpha")
    base = _reference(agent_model_path, {}, None)
    for turn in turns:
        expected = _logprobs(reference, turn["prompt_ids"], turn["output_ids"])
        torch.testing.assert_close(torch.tensor(turn["logprobs"]), expected, atol=2e-4, rtol=0)
    ids = torch.tensor([turns[-1]["prompt_ids"] + turns[-1]["output_ids"]])
    with torch.no_grad():
        moved = (reference(input_ids=ids).logits - base(input_ids=ids).logits).abs().max()
    assert moved > 1e-2  # the adapter is not the base: the logprobs above are the adapter's, not the base's
