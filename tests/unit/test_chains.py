"""``pipeline.chains.chain_tokens``: one layout for the gateway's chains and the assembler's trajectories.

No servers: the gateway's own ``Turn`` and ``Session`` types, and the events its ``EventRecorder``
makes of them, are built in memory.
"""

from __future__ import annotations

import random
import time
from dataclasses import FrozenInstanceError, dataclass

import pytest

from consumers.trajectories import SessionEvents, build_trajectories
from pipeline import TokenChain, chain_tokens
from pipeline.events import Event, TurnCompleted
from stream_gateway.capture import EventRecorder
from stream_gateway.engines import SamplingParams
from stream_gateway.sessions import Session, Turn


@dataclass(frozen=True)
class _Turn:
    """The least a turn needs to be laid out."""

    turn_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reasoning_tokens: int = 0


def test_prompt_ids_are_masked_and_sampled_ids_carry_their_logprobs() -> None:
    chain = chain_tokens(
        [
            _Turn("a", (1, 2, 3), (4, 5), (-0.5, -0.25), reasoning_tokens=1),
            _Turn("b", (1, 2, 3, 4, 5, 6, 7), (8,), (-1.0,)),
            _Turn("c", (1, 2, 3, 4, 5, 6, 7, 8, 9), (10, 11), (-0.125, -2.0), reasoning_tokens=2),
        ]
    )
    assert chain == TokenChain(
        turn_ids=("a", "b", "c"),
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),
        loss_mask=(0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1),
        logprobs=(0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -0.125, -2.0),
        reasoning_mask=(0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1),  # each turn's first reasoning_tokens sampled ids
        prompt_length=3,
        output_starts=(3, 7, 9),
    )


def test_appended_prompts_give_the_same_layout_as_whole_ones() -> None:
    whole = [
        _Turn("a", (1, 2, 3), (4, 5), (-0.5, -0.25)),
        _Turn("b", (1, 2, 3, 4, 5, 6, 7), (8,), (-1.0,)),
        _Turn("c", (1, 2, 3, 4, 5, 6, 7, 8), (9,), (-3.0,)),  # appended nothing: a retry of the same context
    ]
    appended = [
        _Turn("a", (1, 2, 3), (4, 5), (-0.5, -0.25)),
        _Turn("b", (6, 7), (8,), (-1.0,)),
        _Turn("c", (), (9,), (-3.0,)),
    ]
    assert chain_tokens(appended, prompts="appended") == chain_tokens(whole)
    assert chain_tokens(whole).output_starts == (3, 7, 8)


def test_a_whole_prompt_is_trusted_to_extend_the_chain() -> None:
    """The gateway compares ids before it makes a turn a child; the layout only takes what is new."""
    chain = chain_tokens([_Turn("a", (1, 2), (3,), (-1.0,)), _Turn("b", (9, 9, 9, 4), (5,), (-2.0,))])
    assert chain.token_ids == (1, 2, 3, 4, 5)
    assert chain.loss_mask == (0, 0, 1, 0, 1)


def test_no_turns_is_an_empty_chain_and_a_chain_is_immutable() -> None:
    empty = chain_tokens([])
    assert empty == TokenChain((), (), (), (), (), 0, ())
    with pytest.raises(FrozenInstanceError):
        empty.prompt_length = 1  # type: ignore[misc]


def _session_tree(rng: random.Random) -> tuple[Session, list[Event]]:
    """A gateway session of four turns (a chain of three and a branch off the first), and its events."""
    events: list[Event] = []
    recorder = EventRecorder(events.append, "fake")
    session = Session("chains", "sk-chains", time.time(), time.time())
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, seed=None, top_logprobs=0)
    made: list[Turn] = []
    for i, parent in enumerate([None, 0, 1, 0]):
        above = made[parent] if parent is not None else None
        appended = tuple(rng.randrange(2000) for _ in range(rng.randint(0 if above else 1, 6)))
        prefix = (*above.prompt_ids, *above.output_ids) if above else ()
        output = tuple(rng.randrange(2000) for _ in range(rng.randint(1, 5)))
        turn = Turn(
            turn_id=f"t{i}",
            session_id=session.session_id,
            parent_id=above.turn_id if above else None,
            key=None,
            context_length=1,
            prompt_ids=(*prefix, *appended),
            reused_prompt_tokens=len(prefix),
            output_ids=output,
            logprobs=tuple(-rng.random() for _ in output),
            finish_reason="stop",
            content="",
            tool_calls=(),
            policy_version=0,
            policy_versions=((0, 0),),
            created_at=1000.0 + i,
            time_to_first_token_s=0.01,
            duration_s=0.1,
            matches_full_render=True,
            fallback_reason=None,
        )
        session.turns[turn.turn_id] = turn
        recorder.turn_finished(session, turn, "req", 0, params, None)
        made.append(turn)
    return session, events


def test_gateway_turns_and_their_events_lay_out_as_the_gateways_chains() -> None:
    """Both turn types fit :class:`pipeline.ChainTurn`; whole and appended forms agree with ``Session.chains``."""
    session, events = _session_tree(random.Random(7))
    records = {e.turn_id: e for e in events if isinstance(e, TurnCompleted)}
    chains = session.chains()
    assert [c.turn_ids for c in chains] == [("t0", "t1", "t2"), ("t0", "t3")]
    for chain in chains:
        turns = [session.turns[t] for t in chain.turn_ids]
        laid_out = chain_tokens(turns)
        assert (laid_out.turn_ids, laid_out.token_ids, laid_out.loss_mask, laid_out.logprobs) == (
            chain.turn_ids,
            chain.token_ids,
            chain.loss_mask,
            chain.logprobs,
        )
        assert laid_out.prompt_length == len(turns[0].prompt_ids)
        assert laid_out.output_starts == tuple(len(t.prompt_ids) for t in turns)
        assert chain_tokens([records[t] for t in chain.turn_ids], prompts="appended") == laid_out


def test_the_assemblers_trajectories_are_the_gateways_chains() -> None:
    """With every chain training its shared turns (``shared_turns="every"``) a trajectory is its chain;
    by default (``"once"``) the same but for the shared turns' mask, owned by the first chain."""
    session, events = _session_tree(random.Random(8))
    trajectories = build_trajectories(SessionEvents.of(events), emitted_because="closed", shared_turns="every")
    once = build_trajectories(SessionEvents.of(events), emitted_because="closed")
    assert [t.token_ids for t in once] == [t.token_ids for t in trajectories]
    owners: dict[str, int] = {}
    for trajectory in once:
        for s in trajectory.turns:
            owners[s.turn_id] = owners.get(s.turn_id, 0) + s.trained
            assert trajectory.loss_mask[s.start : s.start + s.length] == [int(s.trained)] * s.length
    assert set(owners.values()) == {1}  # each sampled turn in exactly one loss mask
    by_turns = {tuple(s.turn_id for s in t.turns): t for t in trajectories}
    for chain in session.chains():
        trajectory = by_turns[chain.turn_ids]
        assert tuple(trajectory.token_ids) == chain.token_ids
        assert tuple(trajectory.loss_mask) == chain.loss_mask
        assert tuple(trajectory.logprobs) == chain.logprobs
        assert [s.start for s in trajectory.turns] == [len(session.turns[t].prompt_ids) for t in chain.turn_ids]
