"""The whole path, with real parts only: agent traffic → gateway → NATS → assembler → batcher → verl.

Real multi-turn tool sessions and chats go through gateways that capture into a real nats-server.
The tool sessions come from the scripted engine on untrained models, served as ``tiny-agent`` (the
tiny model: it calls ``read``, then answers after the result) or ``tiny-reasoning``
(``tiny-reasoning-untrained``: it thinks before each call and answer); the chats from the untrained
tiny model sampling on the transformers engine. The assembler and the batcher run as they do under
``stream-gateway up``. The batch they write is loaded as the verl adapter loads it, turned into
verl's ``DataProto``, run through verl's GRPO advantage, and checked by a forward pass of the same
(untrained) models: the logprob of every response token the batch marks as sampled equals the one
the gateway recorded while streaming it, thinking tokens included (they stay in the loss mask;
``reasoning_mask`` marks them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from consumers.parquet import decode_batch
from consumers.verl_adapter import StreamAgentLoopManager, StreamSettings
from consumers.verl_batch import padded_batch, to_data_proto
from pipeline.embedded import EmbeddedNatsServer
from pipeline.vision import image_digest
from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import resolve_model, vl_answer
from stream_gateway.moe import replay_routes

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.images import image_part, png
from ..support.lora import make_adapter
from ..support.servers import RunningGateway, run_gateway, scripted_settings
from ..support.waiting import wait_until

ATOL = 2e-4
KEY = "sk-e2e"


@contextlib.contextmanager
def consumers(server: EmbeddedNatsServer, batch_dir: Path) -> Iterator[None]:
    """The assembler and the batcher on their own event loop, as ``up`` runs them."""
    assembler = AssemblerConfig(servers=(server.url,), ack_wait_s=10)
    batcher = BatcherConfig.of(
        servers=(server.url,), batch_size=4, group_size=2, prompt_length=512, response_length=512, output_dir=batch_dir
    )
    with anyio.from_thread.start_blocking_portal() as portal:
        futures = [portal.start_task_soon(run_assembler, assembler), portal.start_task_soon(run_batcher, batcher)]
        try:
            yield
        finally:
            for future in futures:
                future.cancel()
            for future in futures:
                with contextlib.suppress(concurrent.futures.CancelledError):
                    future.result(timeout=30)


def _run_session(gateway: RunningGateway, model: str, group: str, seed: int, reward: float, workdir: Path) -> str:
    """One streamed session to its end, rated and closed; its id."""
    session = f"e2e{secrets.token_hex(4)}"
    base = f"{gateway.base_url}/sessions/{session}"
    if group == "readme":
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What does the README say?"}]
        follow_ups: list[str] = []
    else:
        messages = [{"role": "user", "content": "Tell me a story."}]
        follow_ups = ["More."]
    with OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0) as client:
        drive_session(
            client,
            model,
            messages,
            follow_ups=follow_ups,
            workdir=workdir,
            tools=[READ_TOOL] if group == "readme" else None,
            max_rounds=4,
            temperature=1.0,
            seed=seed,
            max_tokens={"tiny-agent": 64, "tiny-reasoning": 128}.get(model, 16),
            metadata={"group": group},
        )
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/feedback", json={"score": reward}, headers=headers).is_success
    assert httpx.post(f"{base}/close", headers=headers).is_success
    return session


@pytest.mark.parametrize("agent", ["tiny-agent", "tiny-reasoning"])
def test_agent_traffic_becomes_a_verl_batch_whose_logprobs_a_forward_pass_reproduces(
    agent: str, tiny_model_path: Path, reasoning_model_path: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "README.md").write_text("The secret word is lighthouse.\n")
    batch_dir = tmp_path / "batches"
    # The agent on the scripted engine (untrained weights), the chats sampled by the untrained tiny.
    models = {agent: tiny_model_path if agent == "tiny-agent" else reasoning_model_path, "tiny": tiny_model_path}
    with EmbeddedNatsServer() as server, consumers(server, batch_dir):
        sessions = []
        for name, path in models.items():
            options: dict[str, Any] = {"nats_url": server.url, "outbox_dir": tmp_path / f"outbox-{name}"}
            if name == agent:
                settings = scripted_settings(path, name, **options)
            else:
                settings = Settings(model=str(path), served_model_name=name, **options)
            group = "readme" if name == agent else "chat"
            with run_gateway(build_engine(settings), settings) as gateway:
                for seed, reward in ((11, 1.0), (12, -1.0)):
                    sessions.append(_run_session(gateway, name, group, seed, reward, workdir))
        wait_until(lambda: any(batch_dir.glob("*.parquet")), "the batcher's parquet batch", timeout=120)
    [batch_file] = list(batch_dir.glob("*.parquet"))
    trajectories, uids = decode_batch(batch_file.read_bytes())
    assert sorted(t.session_id for t in trajectories) == sorted(sessions)
    [tenant] = {t.tenant for t in trajectories}  # one key: a group label is that tenant's name
    assert sorted(uids) == [f"{tenant}/{group}" for group in ("chat", "chat", "readme", "readme")]
    by_model = {t.model for t in trajectories}
    assert by_model == {agent, "tiny"}
    for trajectory in trajectories:
        assert trajectory.reward in (1.0, -1.0) and trajectory.reward_source == "feedback"
        assert trajectory.num_turns == 2  # a tool loop (call, answer) or a chat and its follow-up
        assert 0 in trajectory.loss_mask[trajectory.prompt_length :]  # tool result / user text between turns

    batch = padded_batch(trajectories, uids, prompt_length=512, response_length=512, pad_token_id=0)
    proto = to_data_proto(batch)
    proto.check_consistency()
    tensors = proto.batch
    scores = tensors["rm_scores"].sum(-1)
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=tensors["rm_scores"],
        response_mask=tensors["response_mask"],
        index=proto.non_tensor_batch["uid"],
    )
    for uid in set(uids):
        rows = torch.tensor([u == uid for u in uids])
        assert sorted(scores[rows].tolist()) == [-1.0, 1.0]
        # Two samples scored -1 and +1: GRPO gives them -1/sqrt(2) and +1/sqrt(2) on every token.
        per_row = advantages[rows].sum(-1) / tensors["response_mask"][rows].sum(-1)
        torch.testing.assert_close(per_row.sort().values, torch.tensor([-0.70710678, 0.70710678]), atol=1e-3, rtol=0)

    p, r = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    mask = tensors["response_mask"].bool()
    thinking = tensors["reasoning_mask"].bool()
    assert not (thinking & ~mask).any()  # thinking is sampled, and stays in the loss mask
    for row, trajectory in enumerate(trajectories):
        thinks = trajectory.model == "tiny-reasoning"
        assert bool(thinking[row].any()) == thinks, trajectory.model
    for name, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rows = torch.tensor([t.model == name for t in trajectories])  # a model's own rows (its own vocabulary)
        with torch.no_grad():
            logits = model(
                input_ids=tensors["input_ids"][rows],
                attention_mask=tensors["attention_mask"][rows],
                position_ids=tensors["position_ids"][rows],
            ).logits[:, p - 1 : p + r - 1]
        log_prob = torch.log_softmax(logits, dim=-1).gather(2, tensors["responses"][rows].unsqueeze(2)).squeeze(2)
        checked = mask[rows]
        assert checked.sum() > 10, name
        recorded = tensors["rollout_log_probs"][rows]
        torch.testing.assert_close(log_prob[checked], recorded[checked], atol=ATOL, rtol=0)
        if name == "tiny-reasoning":  # every thinking token's logprob among them
            assert thinking[rows].sum() > 10
            torch.testing.assert_close(log_prob[thinking[rows]], recorded[thinking[rows]], atol=ATOL, rtol=0)


def test_moe_traffic_becomes_a_verl_batch_whose_routes_replay_the_recorded_logprobs(tmp_path: Path) -> None:
    """tiny-moe sessions through NATS, the assembler and the batcher: the batch's ``routed_experts``
    (int16 [B, P+R, layers, top_k], as verl's router replay reads them) forced into a forward pass
    of the same model reproduce every sampled token's recorded logprob."""
    batch_dir = tmp_path / "batches"
    path = Path(resolve_model("tiny-moe"))
    with EmbeddedNatsServer() as server, consumers(server, batch_dir):
        settings = Settings(
            model=str(path), served_model_name="tiny-moe", nats_url=server.url, outbox_dir=tmp_path / "o"
        )
        with run_gateway(build_engine(settings), settings) as gateway:
            sessions = [
                _run_session(gateway, "tiny-moe", group, seed, reward, tmp_path)
                for group in ("chat", "story")
                for seed, reward in ((11, 1.0), (12, -1.0))
            ]
        wait_until(lambda: any(batch_dir.glob("*.parquet")), "the batcher's parquet batch", timeout=120)
    [batch_file] = list(batch_dir.glob("*.parquet"))
    trajectories, uids = decode_batch(batch_file.read_bytes())
    assert sorted(t.session_id for t in trajectories) == sorted(sessions)
    assert all(t.routed_experts is not None for t in trajectories)
    tensors = to_data_proto(
        padded_batch(trajectories, uids, prompt_length=512, response_length=512, pad_token_id=0)
    ).batch
    routes = tensors["routed_experts"]
    assert routes.dtype == torch.int16 and routes.shape == (*tensors["input_ids"].shape, 3, 2)
    p, r = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    mask = tensors["response_mask"].bool()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def response_logprobs(forced: torch.Tensor | None) -> torch.Tensor:
        inputs = {k: tensors[k] for k in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad(), replay_routes(model, forced) if forced is not None else contextlib.nullcontext():
            logits = model(**inputs).logits[:, p - 1 : p + r - 1]
        return torch.log_softmax(logits, dim=-1).gather(2, tensors["responses"].unsqueeze(2)).squeeze(2)

    recorded = tensors["rollout_log_probs"]
    replayed = response_logprobs(routes.to(torch.int64))
    assert mask.sum() > 20
    torch.testing.assert_close(replayed[mask], recorded[mask], atol=1e-5, rtol=0)


def test_adapter_traffic_becomes_a_verl_batch_of_that_adapter_whose_logprobs_peft_reproduces(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Sessions served by a LoRA adapter through NATS, the assembler and the batcher: the batch
    names the adapter, and base + adapter (PEFT) reproduces every sampled logprob from it alone."""
    import peft

    adapter = make_adapter(tiny_model_path, {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}, 5,
                           tmp_path / "alpha")  # fmt: skip
    batch_dir = tmp_path / "batches"
    with EmbeddedNatsServer() as server, consumers(server, batch_dir):
        settings = Settings(model=str(tiny_model_path), served_model_name="tiny", lora=(f"alpha={adapter}",),
                            nats_url=server.url, outbox_dir=tmp_path / "o")  # fmt: skip
        with run_gateway(build_engine(settings), settings) as gateway:
            sessions = [
                _run_session(gateway, "alpha", group, seed, reward, tmp_path)
                for group in ("chat", "story")
                for seed, reward in ((11, 1.0), (12, -1.0))
            ]
        wait_until(lambda: any(batch_dir.glob("*.parquet")), "the batcher's parquet batch", timeout=120)
    [batch_file] = list(batch_dir.glob("*.parquet"))
    trajectories, uids = decode_batch(batch_file.read_bytes())
    assert sorted(t.session_id for t in trajectories) == sorted(sessions)
    assert {t.adapter for t in trajectories} == {"alpha"}
    proto = to_data_proto(padded_batch(trajectories, uids, prompt_length=512, response_length=512, pad_token_id=0))
    assert list(proto.non_tensor_batch["adapter"]) == ["alpha"] * 4
    tensors = proto.batch
    p, r = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    mask = tensors["response_mask"].bool()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(**{k: tensors[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    logprobs = torch.log_softmax(logits[:, p - 1 : p + r - 1], -1).gather(2, tensors["responses"].unsqueeze(2))
    assert mask.sum() > 20
    torch.testing.assert_close(logprobs.squeeze(2)[mask], tensors["rollout_log_probs"][mask], atol=ATOL, rtol=0)


def _run_image_session(
    gateway: RunningGateway, group: str, seed: int, reward: float, images: list[bytes]
) -> tuple[str, list[str]]:
    """A two-turn chat on tiny-vl: an image and a question, then another image and a question (the
    first image sent again with the history), at temperature 1, top_p 1; rated and closed. The
    session's id and its answers."""
    session = f"vl{secrets.token_hex(4)}"
    base = f"{gateway.base_url}/sessions/{session}"
    sampling: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "seed": seed, "max_tokens": 12}
    messages: list[Any] = []
    answers = []
    with OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=120, max_retries=0) as client:
        for image, question in zip(images, ("What colour is this?", "And this one?"), strict=True):
            messages.append({"role": "user", "content": [image_part(image), {"type": "text", "text": question}]})
            reply = client.chat.completions.create(
                model="tiny-vl", messages=messages, metadata={"group": group}, **sampling
            )
            answers.append(reply.choices[0].message.content or "")
            messages.append({"role": "assistant", "content": answers[-1]})
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/feedback", json={"score": reward}, headers=headers).is_success
    assert httpx.post(f"{base}/close", headers=headers).is_success
    return session, answers


async def _stored_objects(url: str) -> list[str]:
    import nats

    nc = await nats.connect(url)
    try:
        store = await nc.jetstream().object_store("sg_images")
        return sorted(info.name for info in await store.list())
    finally:
        await nc.close()


def test_the_verl_batch_of_an_image_session_reproduces_every_recorded_logprob_from_the_batch_alone(
    vl_model_path: Path, tmp_path: Path
) -> None:
    """Image chats (tiny-vl-untrained on the scripted engine, served as tiny-vl: it names the last
    image's colour) through NATS, the assembler, the batcher and the verl manager (which fetches
    each image from ``sg_images``, processes it again and checks its pixel digest): a forward pass
    of the Hugging Face model over only the batch's ``input_ids``, ``attention_mask``,
    ``position_ids`` (rows 1-3: the multimodal rotary positions) and its rows' ``multi_modal_inputs``
    reproduces every recorded logprob; the bucket holds each distinct image once."""
    path = vl_model_path
    red, blue = png((230, 20, 20)), png((20, 20, 230), (64, 120))
    orders = {"red-first": ([red, blue], ["red", "blue"]), "blue-first": ([blue, red], ["blue", "red"])}
    with EmbeddedNatsServer() as server, consumers(server, tmp_path / "batches"):
        settings = scripted_settings(path, "tiny-vl", nats_url=server.url, outbox_dir=tmp_path / "o")
        with run_gateway(build_engine(settings), settings) as gateway:
            sessions = []
            for group, (images, colours) in orders.items():
                for seed, reward in ((11, 1.0), (12, -1.0)):
                    session, answers = _run_image_session(gateway, group, seed, reward, images)
                    assert answers == [vl_answer(colour) for colour in colours], answers  # each image reached it
                    sessions.append(session)
        pad = AutoTokenizer.from_pretrained(path).pad_token_id
        with StreamAgentLoopManager(
            settings=StreamSettings(nats_url=server.url, prompt_length=512, response_length=512, pad_token_id=pad)
        ) as manager:
            proto = manager.generate_sequences()
        stored = anyio.run(_stored_objects, server.url)
    assert [name for name in stored if name.startswith("images/")] == sorted(
        f"images/{image_digest(data)}" for data in (red, blue)
    )
    assert len(stored) == 3 and stored[-1].startswith("processors/")  # and the processor that made them
    assert sorted(proto.non_tensor_batch["session_id"]) == sorted(sessions)
    assert list(proto.non_tensor_batch["__num_turns__"]) == [4] * 4  # each chat one chain: turn 2 continued turn 1
    tensors, rows = proto.batch, list(proto.non_tensor_batch["multi_modal_inputs"])
    assert tensors["position_ids"].shape == (4, 4, 1024)
    assert [len(row["image_grid_thw"]) for row in rows] == [2, 2, 2, 2]
    p, r = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"][:, 1:].transpose(0, 1),  # [3, B, P+R]: the rotary axes
            pixel_values=torch.cat([row["pixel_values"] for row in rows]),
            image_grid_thw=torch.cat([row["image_grid_thw"] for row in rows]),
        ).logits[:, p - 1 : p + r - 1]
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, tensors["responses"].unsqueeze(2)).squeeze(2)
    mask = tensors["response_mask"].bool()
    assert mask.sum() > 10
    torch.testing.assert_close(logprobs[mask], tensors["rollout_log_probs"][mask], atol=1e-4, rtol=0)
