"""The batcher's grouping policy and its batch record, without NATS.

:class:`consumers.grouping.GroupPlanner` is driven directly, with a clock the test moves; the
batcher's own tests (``tests/consumers/test_batcher.py``) run the same decisions against a real nats-server.
"""

from __future__ import annotations

import hashlib
import random

import orjson
import pytest

from consumers import BatcherConfig, BatchRecord, GroupingPolicy, GroupPlanner
from consumers.grouping import DroppedGroup, PlannedBatch, prepare_trajectory
from consumers.trajectory import Trajectory
from consumers.verl_batch import group_uid

from ..support.trajectories import make_trajectory

T = "tenant1"  # make_trajectory's tenant: a group label is a name within its tenant (issue 55)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ids(trajectories: list[Trajectory]) -> tuple[str, ...]:
    return tuple(t.trajectory_id for t in trajectories)


def _admit_all(planner: GroupPlanner, trajectories: list[Trajectory]) -> None:
    for t in trajectories:
        admission = planner.admit(t)
        assert admission.outcome == t and admission.released is None


def test_whole_groups_make_batches_in_completion_order_and_incomplete_ones_wait() -> None:
    rng = random.Random(1)
    planner = GroupPlanner(GroupingPolicy(batch_size=8, group_size=4))
    g1, g2, g3 = ([make_trajectory(rng, group=g) for _ in range(4)] for g in ("g1", "g2", "g3"))
    _admit_all(planner, [g3[0], g1[0], g2[0], g1[1], g3[1], g2[1], g1[2], g2[2], g1[3], g3[2]])
    assert planner.next_batch() is None  # g1 whole, g2 and g3 not
    _admit_all(planner, [g2[3]])
    assert planner.next_batch() == PlannedBatch(_ids(g1 + g2), (f"{T}/g1",) * 4 + (f"{T}/g2",) * 4)
    assert planner.next_batch() is None and planner.open_groups == 1


def test_oversized_groups_split_and_a_missing_metadata_key_groups_by_prompt() -> None:
    rng = random.Random(2)
    planner = GroupPlanner(GroupingPolicy(batch_size=4, group_size=2))
    branched = [make_trajectory(rng, group="g5") for _ in range(4)]
    by_prompt = [make_trajectory(rng, group=None, prompt=[5, 6, 7, 8]) for _ in range(2)]
    _admit_all(planner, branched + by_prompt)
    assert planner.next_batch() == PlannedBatch(_ids(branched), (f"{T}/g5", f"{T}/g5", f"{T}/g5.1", f"{T}/g5.1"))
    uid = group_uid(by_prompt[0], "prompt")
    assert planner.next_batch() is None and planner.open_groups == 0
    _admit_all(planner, [make_trajectory(rng, group=None, prompt=[5, 6, 7, 8]) for _ in range(2)])
    plan = planner.next_batch()
    assert plan is not None and plan.uids == (uid, uid, f"{uid}.1", f"{uid}.1")


def test_staleness_is_measured_from_the_newest_version_known() -> None:
    rng = random.Random(3)
    planner = GroupPlanner(GroupingPolicy(batch_size=1, max_staleness=2))
    assert planner.current_version is None
    old = make_trajectory(rng, version=1)
    assert planner.admit(old).outcome == old  # nothing known yet: nothing is stale
    planner.note_policy(5)
    assert planner.current_version == 5
    assert planner.admit(make_trajectory(rng, version=2)).outcome == "stale"
    assert planner.admit(make_trajectory(rng, version=3)).outcome != "stale"
    planner.note_trajectory(make_trajectory(rng, version=9))
    planner.note_policy(6)  # an older announcement does not lower what is known
    assert planner.current_version == 9


def test_a_group_with_a_dropped_member_is_released_whole() -> None:
    rng = random.Random(4)
    planner = GroupPlanner(GroupingPolicy(batch_size=3, group_size=3))
    kept, unrewarded, last = (make_trajectory(rng, group="g1", reward=r) for r in (1.0, None, 1.0))
    assert planner.admit(kept).outcome == kept
    admission = planner.admit(unrewarded)
    assert admission.outcome == "no_reward" and admission.released is None
    assert planner.admit(unrewarded).released is None  # a second copy of a dropped one counts once
    admission = planner.admit(last)
    assert admission.outcome == last
    assert admission.released == DroppedGroup(f"{T}/g1", _ids([kept, last]))
    assert planner.next_batch() is None and planner.open_groups == 0


def test_an_incomplete_group_expires_after_group_timeout_s() -> None:
    rng = random.Random(5)
    clock = _Clock()
    planner = GroupPlanner(GroupingPolicy(batch_size=2, group_size=2, group_timeout_s=10.0), clock)
    early, late = make_trajectory(rng, group="early"), make_trajectory(rng, group="late")
    planner.admit(early)
    clock.now += 6
    planner.admit(late)
    clock.now += 5
    assert planner.expire() == [DroppedGroup(f"{T}/early", _ids([early]))]
    assert planner.open_groups == 1
    assert GroupPlanner(GroupingPolicy(group_size=2)).expire() == []  # no timeout: groups wait forever


def test_policies_cut_or_drop_long_responses_and_default_rewards() -> None:
    rng = random.Random(6)
    long = make_trajectory(rng, prompt_len=4, response_len=12)
    cut = prepare_trajectory(long, prompt_length=8, response_length=8, overlong="truncate", no_reward="drop")
    assert isinstance(cut, Trajectory) and cut.truncated and cut.token_ids == long.token_ids[:12]
    assert all(turn.start + turn.length <= 12 for turn in cut.turns)
    assert prepare_trajectory(long, prompt_length=8, response_length=8, overlong="drop", no_reward="drop") == "length"
    unrewarded = make_trajectory(rng, reward=None)
    zero = prepare_trajectory(unrewarded, prompt_length=8, response_length=16, overlong="drop", no_reward="zero")
    assert isinstance(zero, Trajectory) and (zero.reward, zero.reward_source) == (0.0, "default")
    bad = long.model_copy(update={"loss_mask": [1, *long.loss_mask[1:]]})  # a sampled id inside the prompt
    policies = {"prompt_length": 8, "response_length": 16, "overlong": "drop", "no_reward": "zero"}
    assert prepare_trajectory(bad, **policies) == "malformed"  # type: ignore[arg-type]


def test_a_cut_keeps_thinking_aligned_and_a_bad_reasoning_mask_is_malformed() -> None:
    """The cut takes ``reasoning_mask`` with the ids; a turn cut inside its thinking has no answer left."""
    long = make_trajectory(random.Random(9), prompt_len=4, response_len=12)  # turns at 4 (6 ids) and 13 (3 ids)
    first = long.turns[0].model_copy(update={"reasoning_tokens": 5, "answer_start": 5})
    thinking = long.model_copy(
        update={"turns": [first, *long.turns[1:]], "reasoning_mask": [0] * 4 + [1] * 5 + [0] * 7}
    )
    policies = {"prompt_length": 8, "overlong": "truncate", "no_reward": "drop"}
    inside = prepare_trajectory(thinking, response_length=4, **policies)  # type: ignore[arg-type]
    assert isinstance(inside, Trajectory) and inside.reasoning_mask == [0] * 4 + [1] * 4
    assert [(t.length, t.reasoning_tokens, t.answer_start) for t in inside.turns] == [(4, 4, None)]
    after = prepare_trajectory(thinking, response_length=7, **policies)  # type: ignore[arg-type]
    assert isinstance(after, Trajectory) and after.reasoning_mask == thinking.reasoning_mask[:11]
    assert [(t.length, t.reasoning_tokens, t.answer_start) for t in after.turns] == [(6, 5, 5)]
    for bad in ([0] * 15, [1] + [0] * 15, [0] * 4 + [2] + [0] * 11, [0] * 10 + [1] + [0] * 5):  # short, prompt, 2, tool
        changed = thinking.model_copy(update={"reasoning_mask": bad})
        assert prepare_trajectory(changed, response_length=16, **policies) == "malformed"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": 10, "group_size": 4}, "batch_size 10 must be a positive multiple of group_size 4"),
        ({"group_key": "metadata:"}, "group_key 'metadata:': expected 'prompt' or 'metadata:<name>'"),
        ({"prompt_length": 0}, "prompt_length and response_length must be positive"),
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
    ],
)
def test_an_invalid_policy_says_why_as_the_batchers_config_does(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GroupingPolicy(**fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        BatcherConfig.of(**fields)
    with pytest.raises(ValueError, match="max_pending 8 must be at least batch_size 16"):
        BatcherConfig(max_pending=8)


def test_the_batch_records_wire_form_is_the_dict_the_batcher_wrote() -> None:
    """Field for field and byte for byte what the batcher stored before the record was typed."""
    members = ("tr1", "tr0")
    plan = PlannedBatch(members, ("q1", "q1"))
    policy = GroupingPolicy(batch_size=2, group_size=2, prompt_length=16, response_length=32, no_reward="zero")
    record = BatchRecord.assign(plan, policy, created_at=123.5).committed(7)
    legacy = {
        "batch_id": hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest(),
        "state": "assigned",
        "members": list(members),
        "uids": ["q1", "q1"],
        "group_size": 2,
        "prompt_length": 16,
        "response_length": 32,
        "overlong": "truncate",
        "no_reward": "zero",
        "created_at": 123.5,
    }
    legacy["batches_last_seq"] = 7  # added at the commit, after the rest
    assert record.encode() == orjson.dumps(legacy)
    assert record.published().encode() == orjson.dumps(legacy | {"state": "published"})
    assert BatchRecord.decode(record.encode()) == record
    uncommitted = BatchRecord.assign(plan, policy, created_at=123.5)
    assert orjson.loads(uncommitted.encode()) == {k: v for k, v in legacy.items() if k != "batches_last_seq"}
