"""Training data that says what it is (issue 42), through the real pipeline: gateway → NATS →
assembler → batcher → the parquet batch and verl's padded batch.

Two gateway replicas capture into one nats-server (the tiny model on the transformers engine; the
synthetic engine at a slow pace, for a stream the client walks away from), the assembler keeps
aborted turns, the batcher writes parquet files. Checked on what reaches the trainer: each end
reason, and a forked session's shared sampled tokens in exactly one loss mask.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from openai import OpenAI

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from consumers.parquet import BatchManifest, decode_batch
from consumers.trajectory import Trajectory
from consumers.verl_batch import padded_batch
from pipeline.embedded import EmbeddedNatsServer
from pipeline.kv import current_entries

from ..support.capture import read_trajectories
from ..support.replicas import close_session, tiny_and_slow
from ..support.waiting import wait_until

KEY = "sk-data"
SESSIONS = 5  # below: six trajectories, one batch
# Finite answers (an enum), so that a constrained turn always ends by itself, never at max_tokens.
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"], "additionalProperties": False}
PICK = {"type": "function", "function": {"name": "pick", "description": "Pick one", "parameters": SCHEMA}}


@dataclass
class Pipeline:
    tiny: str
    slow: str
    batches: Path
    nats: str

    def client(self, session: str, base: str | None = None) -> OpenAI:
        return OpenAI(base_url=(base or self.tiny) + "/v1", api_key=KEY, default_headers={"x-session-id": session})

    def close(self, session: str) -> None:
        close_session(self.tiny, KEY, session)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("data")
    with EmbeddedNatsServer() as nats, anyio.from_thread.start_blocking_portal() as portal:
        assembler = AssemblerConfig(servers=(nats.url,), idle_timeout_s=3, close_grace_s=1, aborted="keep",
                                    default_reward=1.0)  # fmt: skip
        batcher = BatcherConfig.of(servers=(nats.url,), batch_size=6, group_size=1, prompt_length=2048,
                                   response_length=2048, output_dir=tmp / "batches")  # fmt: skip
        tasks = [portal.start_task_soon(run_assembler, assembler), portal.start_task_soon(run_batcher, batcher)]
        with tiny_and_slow(nats.url, tmp, tiny_model_path) as (a, b):
            yield Pipeline(a, b, tmp / "batches", nats.url)
        for task in tasks:
            task.cancel()


def _traffic(p: Pipeline) -> None:
    ask = [{"role": "user", "content": "Give me a number."}]
    p.client("ends-stop").chat.completions.create(
        model="tiny", messages=ask, max_tokens=200,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},  # type: ignore[typeddict-item]
    )  # fmt: skip
    p.client("ends-tool").chat.completions.create(
        model="tiny", messages=ask, tools=[PICK], max_tokens=300,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "pick"}},
    )  # fmt: skip
    p.client("ends-length").chat.completions.create(model="tiny", messages=ask, max_tokens=5)  # type: ignore[arg-type]
    # A retry: the same second request twice, two continuations of the first turn.
    forked = p.client("forked")
    first = forked.chat.completions.create(model="tiny", messages=ask, max_tokens=6)  # type: ignore[arg-type]
    history = [
        *ask,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    for _ in range(2):
        forked.chat.completions.create(model="tiny", messages=history, max_tokens=6)  # type: ignore[arg-type]
    for session in ("ends-stop", "ends-tool", "ends-length", "forked"):
        p.close(session)
    stream = p.client("ends-client-gone", p.slow).chat.completions.create(
        model="tiny",
        messages=ask,
        max_tokens=400,
        stream=True,  # type: ignore[arg-type]
    )
    for count, _chunk in enumerate(stream):
        if count >= 3:
            break
    stream.close()  # walked away: the turn is aborted; the session ends by being idle


def _batch(p: Pipeline) -> list[Trajectory]:
    files = sorted(p.batches.glob("*.parquet")) if p.batches.exists() else []
    return [t for f in files for t in decode_batch(f.read_bytes())[0]]


@pytest.fixture(scope="module")
def rows(pipeline: Pipeline) -> list[Trajectory]:
    """The traffic above, as the batch the trainer gets."""
    _traffic(pipeline)
    wait_until(lambda: len(_batch(pipeline)) == 6, timeout=90, what="one batch of the six trajectories")
    return _batch(pipeline)


async def _manifests(url: str) -> list[BatchManifest]:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        last = (await js.stream_info("SG_BATCHES")).state.last_seq
        return [BatchManifest.decode((await js.get_msg("SG_BATCHES", seq)).data or b"") for seq in range(1, last + 1)]
    finally:
        await nc.close()


def test_every_end_reason_reaches_the_batch_and_shared_turns_are_trained_once(
    pipeline: Pipeline, rows: list[Trajectory]
) -> None:
    ends: dict[str, list[Any]] = {}
    for row in rows:
        ends.setdefault(row.session_id, []).append(row.end_reason)
    assert ends == {
        "ends-stop": ["stop"], "ends-tool": ["tool_calls"], "ends-length": ["length"],
        "ends-client-gone": ["client_disconnected"], "forked": ["length", "length"],
    }  # fmt: skip
    gone = next(r for r in rows if r.session_id == "ends-client-gone")
    assert gone.aborted and gone.abort_reason == "client_disconnected" and "aborted" in gone.health

    # Train-once over the whole batch stream: each sampled turn of a session in exactly one loss mask.
    in_loss: dict[tuple[str, str], int] = {}
    for row in rows:
        for turn in row.turns:
            span = row.loss_mask[turn.start : turn.start + turn.length]
            assert span == [int(turn.trained)] * turn.length  # the mask and the turn agree
            in_loss[(row.session_id, turn.turn_id)] = in_loss.get((row.session_id, turn.turn_id), 0) + sum(span) // max(
                1, turn.length
            )
    assert set(in_loss.values()) == {1}, in_loss
    forks = [r for r in rows if r.session_id == "forked"]
    assert all("forked" in r.health for r in forks)
    assert sum(not t.trained for r in forks for t in r.turns) == 1  # the shared first turn, once out

    # The manifest carries each row's logprob coverage and version lag (for verl's rollout correction).
    [manifest] = anyio.run(_manifests, pipeline.nats)
    assert manifest.trajectory_ids == [r.trajectory_id for r in rows]
    assert manifest.logprob_coverage == [1.0] * 6 and manifest.version_lag == [0] * 6

    # verl's padded batch says the same per row.
    batch = padded_batch(
        rows, [r.trajectory_id for r in rows], prompt_length=2048, response_length=2048, pad_token_id=0
    )
    assert list(batch.non_tensors["sg.end_reason"]) == [r.end_reason for r in rows]
    assert [list(h) for h in batch.non_tensors["sg.health"]] == [r.health for r in rows]
    trained = batch.tensors["response_mask"].sum().item()
    assert trained == sum(sum(r.loss_mask[r.prompt_length :]) for r in rows)


def test_verify_measures_the_mismatch_and_flags_a_perturbed_row(
    pipeline: Pipeline, rows: list[Trajectory], tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-gateway verify`` on the batch as written: the plain sampled rows match a forward pass
    of the model; the grammar-constrained ones (their logprobs are the masked distribution's) and
    the synthetic engine's (made-up logprobs) are flagged. Then one plain row's logprobs, perturbed
    in a copy of the file, flag it too."""
    from consumers.parquet import encode_batch
    from stream_stack.cli import main

    [path] = sorted(pipeline.batches.glob("*.parquet"))
    assert main(["verify", str(path), "--model", str(tiny_model_path), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_session = {rows[r["row"]].session_id: r for r in report["rows"]}
    flagged = {session for session, r in by_session.items() if r["flagged"]}
    assert flagged == {"ends-stop", "ends-tool", "ends-client-gone"}, by_session
    for session in ("ends-length", "forked"):
        assert by_session[session]["max_abs_delta"] < 2e-4 and by_session[session]["kl"] < 1e-6
    assert by_session["ends-length"]["sampled"] == 5

    plain = next(i for i, r in enumerate(rows) if r.session_id == "ends-length")
    logprobs = list(rows[plain].logprobs)
    for position in [p for p, m in enumerate(rows[plain].loss_mask) if m][:3]:
        logprobs[position] += 0.3
    perturbed = [r.model_copy(update={"logprobs": logprobs}) if i == plain else r for i, r in enumerate(rows)]
    copy = path.with_name("perturbed.parquet")
    copy.write_bytes(encode_batch(perturbed, [r.trajectory_id for r in rows], batch_id="perturbed",
                                  prompt_length=2048, response_length=2048))  # fmt: skip
    assert main(["verify", str(copy), "--model", str(tiny_model_path), "--format", "json"]) == 1
    again = {rows[r["row"]].session_id: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert again["ends-length"]["flagged"] and abs(again["ends-length"]["max_abs_delta"] - 0.3) < 1e-3
    assert again["ends-length"]["ratio_min"] < 0.75 and not again["forked"]["flagged"]
    copy.unlink()


def _feedback(p: Pipeline, session: str, score: float) -> None:
    response = httpx.post(f"{p.tiny}/sessions/{session}/feedback", json={"score": score},
                          headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    response.raise_for_status()


async def _late_rewards(url: str) -> dict[str, dict[str, Any]]:
    import nats

    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value("sg_batcher")
        return {key: json.loads(entry.value or b"{}") for key, entry in (await current_entries(kv, "l.>")).items()}
    finally:
        await nc.close()


def test_feedback_after_emission_is_kept_as_a_revision_or_a_late_reward(
    pipeline: Pipeline, rows: list[Trajectory]
) -> None:
    """Feedback that comes after a session's trajectories were emitted is never dropped: before its
    batch, the batcher trains the new revision; after, it is recorded on the batch it went into."""
    # After the batch: ends-length's trajectory is in the published batch of the first test.
    published = next(r for r in rows if r.session_id == "ends-length")
    _feedback(pipeline, "ends-length", -1.0)
    wait_until(lambda: len(anyio.run(_late_rewards, pipeline.nats)) == 1, timeout=30, what="the late reward recorded")
    [late] = anyio.run(_late_rewards, pipeline.nats).values()
    assert (late["trajectory_id"], late["revision"], late["reward"]) == (published.trajectory_id, 1, -1.0)
    assert late["reward_source"] == "feedback"

    # Before the batch: a session emitted, then scored, then five more to fill the next batch.
    ask = [{"role": "user", "content": "Say something."}]
    pipeline.client("scored-late").chat.completions.create(model="tiny", messages=ask, max_tokens=4)  # type: ignore[arg-type]
    pipeline.close("scored-late")
    wait_until(lambda: _emitted(pipeline, "scored-late"), timeout=30, what="scored-late emitted")
    _feedback(pipeline, "scored-late", 0.25)
    wait_until(lambda: _emitted(pipeline, "scored-late", revision=1), timeout=30, what="its revision emitted")
    for i in range(5):
        pipeline.client(f"filler-{i}").chat.completions.create(model="tiny", messages=ask, max_tokens=4)  # type: ignore[arg-type]
        pipeline.close(f"filler-{i}")
    wait_until(lambda: len(_batch(pipeline)) == 12, timeout=60, what="the second batch")
    [scored] = [r for r in _batch(pipeline) if r.session_id == "scored-late"]
    assert (scored.reward, scored.reward_source, scored.revision) == (0.25, "feedback", 1)


def _emitted(p: Pipeline, session: str, revision: int = 0) -> bool:
    return any(t.session_id == session and t.revision == revision for t in read_trajectories(p.nats))


def _trajectories_of(p: Pipeline, session: str) -> list[Trajectory]:
    return [t for t in read_trajectories(p.nats) if t.session_id == session]


def test_a_compacting_client_is_linked_to_the_conversation_it_compacted(pipeline: Pipeline) -> None:
    """A client that replaces its history with a summary (same system prompt, a shorter history)
    starts a new root that says which turn it continues; another agent in the session (another
    system prompt) starts an unlinked one."""
    session = "compacting"
    client = pipeline.client(session)
    system = {"role": "system", "content": "You are a careful coding agent."}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": "Refactor the parser, step by step."}]
    for follow_up in ("Go on.", "And the tests?"):
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=24)  # type: ignore[arg-type]
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": follow_up}]  # fmt: skip
    last = client.chat.completions.create(model="tiny", messages=history, max_tokens=24)  # type: ignore[arg-type]
    compacted = [system, {"role": "user", "content": "Summary: the parser is refactored; the tests remain."}]
    client.chat.completions.create(model="tiny", messages=compacted, max_tokens=8)  # type: ignore[arg-type]
    other = [{"role": "system", "content": "You are a search sub-agent."}, {"role": "user", "content": "Find it."}]
    client.chat.completions.create(model="tiny", messages=other, max_tokens=8)  # type: ignore[arg-type]
    pipeline.close(session)
    wait_until(lambda: len(_trajectories_of(pipeline, session)) == 3, timeout=30, what="three trajectories")
    mine = _trajectories_of(pipeline, session)
    [chain] = [t for t in mine if t.num_turns == 3]  # the conversation before the compaction
    roots = [t for t in mine if t.num_turns == 1]
    linked = [t for t in roots if t.continues_turn_id is not None]
    assert len(linked) == 1 and linked[0].continues_turn_id == chain.turns[-1].turn_id
    assert last.id  # the continued turn is the latest one of the compacted conversation
    [unlinked] = [t for t in roots if t.continues_turn_id is None]
    assert unlinked.trajectory_id != linked[0].trajectory_id
