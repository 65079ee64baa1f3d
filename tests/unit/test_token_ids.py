"""Issue 41: a session's turns hold their ids compactly, a continuation sharing its parent's storage,
so that a session's memory is proportional to its tokens, not to its turns times its context."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from stream_gateway.sessions import Logprobs, Session, TokenIds, Turn, prompt_after


def test_packed_ids_behave_as_the_tuple_they_replace() -> None:
    rng = random.Random(7)
    reference: list[int] = []
    ids = TokenIds()
    for _ in range(40):  # a chain of extensions and cuts, checked against a plain list at every step
        if reference and rng.random() < 0.3:
            n = rng.randrange(len(reference) + 1)
            reference, ids = reference[:n], ids.head(n)
        else:
            added = [rng.randrange(50_000) for _ in range(rng.randrange(5))]
            reference, ids = reference + added, TokenIds(added, ids)
        assert len(ids) == len(reference) and list(ids) == reference and ids.tolist() == reference
        assert ids == tuple(reference) and tuple(reference) == ids and ids == reference
        assert ids == TokenIds(reference) and hash(ids) == hash(TokenIds(reference))
        for start in {0, len(reference) // 2, len(reference), len(reference) + 3}:
            assert ids[start:] == reference[start:] and ids.suffix(start).tolist() == reference[start:]
        assert ids[1:-1] == reference[1:-1] and ids[::2] == reference[::2]
        for i in range(-len(reference), len(reference)):
            assert ids[i] == reference[i]
    with pytest.raises(IndexError):
        ids[len(reference)]
    assert ids != [*reference, 1] and TokenIds([1]) != (2**40,) and ids != "text"


def _turn(session: Session, n: int, parent: Turn | None, added: list[int], output: list[int]) -> Turn:
    reused = len(parent.prompt_ids) + len(parent.output_ids) if parent is not None else 0
    return Turn(
        f"t{n}", session.session_id, parent.turn_id if parent else None, None, 2 * n + 1,
        prompt_after(parent, reused, added), reused, TokenIds(output), Logprobs([-0.5] * len(output)),
        "stop", "", (), 0, ((0, 0),), 0.0, None, 0.0, True, None,
    )  # fmt: skip


def test_a_long_session_holds_each_token_once_in_a_few_bytes() -> None:
    """50 turns of an agent's session, 2k ids appended and 400 sampled each (120k tokens in the
    end): each turn's prompt is the whole conversation, and the session's memory is its tokens'."""
    session = Session("s", "tenant", 0.0, 0.0)
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    parent = None
    for n in range(50):
        added = [rng.randrange(50_000) for _ in range(2_000)]
        parent = _turn(session, n, parent, added, [rng.randrange(50_000) for _ in range(400)])
        session.add(parent)
        del added
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert parent is not None
    tokens = len(parent.prompt_ids) + len(parent.output_ids)
    assert tokens == 120_000 and session.held_tokens == tokens  # each id counted once, not once per turn
    # 4 bytes an id and 8 a logprob (20k of them), plus each turn's bookkeeping; the tuples it
    # replaced held 8 bytes per id per turn: about 25 MB here.
    assert held < 4 * tokens + 8 * 20_000 + 50 * 4_000, held
    # The chain still reads back whole, and a continuation is found by its ids.
    root = session.turns["t0"]
    assert parent.prompt_ids[:2_400] == root.prompt_ids.tolist() + root.output_ids.tolist()
    assert session.match_tokens([*parent.prompt_ids, *parent.output_ids, 5]) is parent
    assert session.match_tokens([*parent.prompt_ids, 5]) is session.turns["t48"]


def test_a_continuation_that_reuses_part_of_its_parent_shares_what_it_reuses() -> None:
    session = Session("s", "tenant", 0.0, 0.0)
    root = _turn(session, 0, None, [1, 2, 3], [4, 5, 6])
    child = Turn(
        "t1", "s", "t0", None, 3, prompt_after(root, 5, [9, 9]), 5, TokenIds([7]), Logprobs([-1.0]),
        "stop", "", (), 0, ((0, 0),), 0.0, None, 0.0, True, None,
    )  # fmt: skip
    assert child.prompt_ids == (1, 2, 3, 4, 5, 9, 9) and child.held == 3
    with pytest.raises(ValueError, match="holds fewer"):
        prompt_after(root, 7, [1])


def test_a_packed_prompt_is_written_to_a_server_as_the_same_json() -> None:
    """The remote engines write a continuation's prompt from a numpy view of its array, no Python
    int made per id: the bytes a server receives are the list's."""
    import orjson

    from stream_gateway.engines import SamplingParams
    from stream_gateway.engines.remote._sglang import SglangDialect
    from stream_gateway.engines.remote._vllm import VllmDialect
    from stream_gateway.engines.remote._vllm_generate import VllmGenerateDialect
    from stream_gateway.sessions import wire_ids

    ids = TokenIds([], TokenIds([0, 9], TokenIds([5, 70_000, 2**31 - 1])))
    assert wire_ids([1, 2]) == [1, 2]
    params = SamplingParams(max_tokens=4)
    for dialect in (VllmDialect(), VllmGenerateDialect(), SglangDialect()):
        packed = dialect.body("r", ids, params, model="m", adapter=None)
        listed = dialect.body("r", ids.tolist(), params, model="m", adapter=None)
        assert orjson.dumps(packed, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(listed), type(dialect)
