"""Trajectories from a gateway session's ``GET /sessions/{id}`` body, for tests.

The same chains the assembler builds from events, built here from the gateway's own view of the
session (its turn tree and chains), so tests can feed real traffic to the batcher without NATS.
The assembler's output is meant to equal this; a test may compare the two.

``make_trajectory`` builds a synthetic one instead (random ids, masks and logprobs), for the
batcher and its grouping policy.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from consumers.trajectory import Trajectory, TurnSummary, trajectory_id


def trajectories_from_session(
    body: Mapping[str, Any],
    reward: float | None = None,
    *,
    tenant: str = "test",
    model: str = "tiny-agent",
    agent: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Trajectory]:
    """One :class:`Trajectory` per chain of ``body["chains"]``, each with the scalar ``reward``.

    ``prompt_length`` is the chain's first turn's prompt length; each turn's ``start`` is its own
    prompt length (its sampled ids follow its prompt); a turn's reward is the latest turn-level
    feedback on it in ``body["feedback"]``. The body does not carry tenant, model, agent or
    metadata: they are given here.
    """
    turns = {t["turn_id"]: t for t in body["turns"]}
    turn_rewards: dict[str, float] = {}
    for feedback in body.get("feedback", []):
        if feedback.get("turn_id") is not None:
            turn_rewards[feedback["turn_id"]] = float(feedback["score"])
    out = []
    for chain in body["chains"]:
        path = [turns[turn_id] for turn_id in chain["turn_ids"]]
        summaries = [
            TurnSummary(
                turn_id=t["turn_id"],
                start=len(t["prompt_ids"]),
                length=len(t["output_ids"]),
                finish_reason=t["finish_reason"],
                policy_version=t["policy_version"],
                policy_versions=[tuple(span) for span in t["policy_versions"]],
                reasoning_tokens=t["reasoning_tokens"],
                answer_start=t["answer_start"],
                reward=turn_rewards.get(t["turn_id"]),
                time_to_first_token_s=t["time_to_first_token_s"],
                duration_s=t["duration_s"],
            )
            for t in path
        ]
        versions = [t["policy_version"] for t in path]
        out.append(
            Trajectory(
                trajectory_id=trajectory_id(body["session_id"], list(chain["turn_ids"])),
                session_id=body["session_id"],
                tenant=tenant,
                model=model,
                agent=agent,
                metadata=dict(metadata or {}),
                token_ids=list(chain["token_ids"]),
                loss_mask=list(chain["mask"]),
                logprobs=list(chain["logprobs"]),
                reasoning_mask=list(chain["reasoning_mask"]),
                prompt_length=len(path[0]["prompt_ids"]),
                turns=summaries,
                num_turns=len(path),
                min_policy_version=min(versions),
                max_policy_version=max(versions),
                reward=reward,
                reward_source=None if reward is None else "test",
                aborted=path[-1]["finish_reason"] is None,
                truncated=False,
                complete=True,
                emitted_because="closed",
                started_at=path[0]["created_at"],
                ended_at=path[-1]["created_at"] + path[-1]["duration_s"],
            )
        )
    return out


def make_trajectory(
    rng: random.Random,
    *,
    group: str | None = "g",
    prompt: list[int] | None = None,
    prompt_len: int = 6,
    response_len: int = 10,
    reward: float | None = 1.0,
    version: int = 0,
    min_version: int | None = None,
) -> Trajectory:
    """A two-turn trajectory: a sampled span, a tool result (mask 0), another sampled span."""
    session = f"s{rng.getrandbits(48):012x}"
    prompt_ids = list(prompt) if prompt is not None else [rng.randrange(1, 100) for _ in range(prompt_len)]
    first = max(1, response_len // 2)
    tool = (response_len - first) // 2
    second = response_len - first - tool
    response = [rng.randrange(1, 100) for _ in range(response_len)]
    mask = [0] * len(prompt_ids) + [1] * first + [0] * tool + [1] * second
    logprobs = (
        [0.0] * len(prompt_ids)
        + [-3 * rng.random() for _ in range(first)]
        + [0.0] * tool
        + [-3 * rng.random() for _ in range(second)]
    )
    low = version if min_version is None else min_version
    turns = [
        TurnSummary(
            turn_id=f"{session}-0", start=len(prompt_ids), length=first, finish_reason="tool_calls", policy_version=low
        )
    ]
    if second:
        start = len(prompt_ids) + first + tool
        turns.append(
            TurnSummary(
                turn_id=f"{session}-1", start=start, length=second, finish_reason="stop", policy_version=version
            )
        )
    return Trajectory(
        trajectory_id=trajectory_id(session, [t.turn_id for t in turns]),
        session_id=session,
        tenant="tenant1",
        model="tiny",
        metadata={"group": group} if group is not None else {},
        token_ids=prompt_ids + response,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_length=len(prompt_ids),
        turns=turns,
        num_turns=len(turns),
        min_policy_version=low,
        max_policy_version=version,
        reward=reward,
        reward_source="feedback" if reward is not None else None,
        emitted_because="closed",
        started_at=1000.0,
        ended_at=1001.5,
    )
