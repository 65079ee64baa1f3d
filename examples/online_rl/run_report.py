"""The run's results: the per-step CSV, the reward plot, the gateway's policy events, the summary.

The decode pauses come from the gateway itself: every replica publishes ``policy.applied`` (with
``pause_s``, how long decoding stopped for the copy and the KV-cache recompute, and ``in_flight``,
the requests decoding across the swap) on the ``SG_EVENTS`` stream; they are read back with
nats-py through an ordered consumer from the start of the stream.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pipeline.events import Event, PolicyApplied, PolicyRejected, decode_event

from grpo_trainer import StepResult
from simulated_users import UserStatistics

__all__ = ["PolicyEvents", "StepRow", "format_summary", "read_policy_events", "write_csv", "write_plot"]

_MIN_PER_VERSION = 4

CSV_COLUMNS = (
    "step",
    "policy_version",
    "mean_reward",
    "n_trajectories",
    "loss",
    "min_policy_version",
    "max_policy_version",
    "ppo_kl",
    "pg_clipfrac",
    "entropy",
    "grad_norm",
    "sampled_tokens",
    "on_policy_logprob_error",
    "elapsed_s",
)


@dataclass(frozen=True, slots=True)
class StepRow:
    """One training step: the published version, when, and what the step saw."""

    step: int
    policy_version: int
    elapsed_s: float  # since the users started
    result: StepResult


@dataclass(frozen=True, slots=True)
class PolicyEvents:
    """The gateway's ``policy.applied`` and ``policy.rejected`` events, in stream order."""

    applied: tuple[PolicyApplied, ...]
    rejected: tuple[PolicyRejected, ...]


async def read_policy_events(nats_url: str, *, stream: str = "SG_EVENTS", prefix: str = "sg") -> PolicyEvents:
    """Every policy event on ``stream`` so far."""
    import nats
    import nats.errors
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from pipeline.subscriber import message_payload

    events: list[Event] = []
    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=3)
    try:
        js = nc.jetstream()
        subscription = await js.subscribe(
            f"{prefix}.events._._.policy.>",
            stream=stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )
        try:
            while True:
                try:
                    msg = await subscription.next_msg(timeout=2.0)
                except nats.errors.TimeoutError:
                    break  # none (left)
                events.append(decode_event(await message_payload(msg, js)))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await subscription.unsubscribe()
    finally:
        await nc.drain()
    return PolicyEvents(
        applied=tuple(e for e in events if isinstance(e, PolicyApplied)),
        rejected=tuple(e for e in events if isinstance(e, PolicyRejected)),
    )


def write_csv(path: Path, rows: Sequence[StepRow]) -> None:
    """One line per step, ``CSV_COLUMNS``."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            r = row.result
            error = "" if r.on_policy_error is None else f"{r.on_policy_error:.3g}"
            writer.writerow(
                [
                    row.step,
                    row.policy_version,
                    f"{r.mean_reward:.4f}",
                    r.n_trajectories,
                    f"{r.loss:.5f}",
                    r.min_policy_version,
                    r.max_policy_version,
                    f"{r.ppo_kl:.5f}",
                    f"{r.pg_clipfrac:.4f}",
                    f"{r.entropy:.4f}",
                    f"{r.grad_norm:.4f}",
                    r.sampled_tokens,
                    error,
                    f"{row.elapsed_s:.1f}",
                ]
            )


def rewards_by_version(rows: Sequence[StepRow]) -> dict[int, list[float]]:
    """Every trained trajectory's reward, by the policy version that sampled most of it."""
    by_version: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        for version, reward in row.result.rewards_by_version:
            by_version[version].append(reward)
    return dict(sorted(by_version.items()))


def tokens_by_version(rows: Sequence[StepRow]) -> dict[int, int]:
    """Sampled tokens trained on, by the policy version that sampled them."""
    totals: dict[int, int] = defaultdict(int)
    for row in rows:
        for version, count in row.result.tokens_per_version.items():
            totals[version] += count
    return dict(sorted(totals.items()))


def write_plot(path: Path, rows: Sequence[StepRow], title: str) -> None:
    """Top: mean reward per training step and per sampling policy version; bottom: staleness and entropy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row.step for row in rows]
    by_version = rewards_by_version(rows)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
    batch_rewards = [row.result.mean_reward for row in rows]
    top.plot(steps, batch_rewards, "o-", ms=3, label="the batch trained at this step")
    enough = {v: r for v, r in by_version.items() if len(r) >= _MIN_PER_VERSION}  # a few are just noise
    top.plot(
        list(enough),
        [float(np.mean(r)) for r in enough.values()],
        "s--",
        ms=4,
        alpha=0.8,
        label=f"trajectories sampled by this policy version (>= {_MIN_PER_VERSION} of them)",
    )
    top.set_ylabel("mean reward (share of digits in the replies)")
    top.set_ylim(-0.02, 1.02)
    top.grid(alpha=0.3)
    top.legend(loc="upper left", title="mean reward of", fontsize="small")
    top.set_title(title)
    # Staleness: how many versions behind the trainer's weights the batch was sampled (the trainer
    # holds version step - 1 when it trains at step): the range, and the token-weighted mean.
    oldest = [row.step - 1 - row.result.min_policy_version for row in rows]
    newest = [row.step - 1 - row.result.max_policy_version for row in rows]
    mean_lag = [
        row.step - 1 - sum(v * n for v, n in row.result.tokens_per_version.items()) / max(1, row.result.sampled_tokens)
        for row in rows
    ]
    bottom.vlines(steps, newest, oldest, lw=3, alpha=0.35, label="staleness of the batch (oldest..newest token)")
    bottom.plot(steps, mean_lag, ".", color="tab:blue", label="mean staleness per sampled token")
    bottom.set_ylabel("versions behind")
    bottom.set_xlabel("training step / policy version")
    bottom.grid(alpha=0.3)
    right = bottom.twinx()
    right.plot(steps, [row.result.entropy for row in rows], color="tab:red", lw=1, label="policy entropy (nats)")
    right.set_ylabel("entropy (nats)")
    handles = bottom.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = bottom.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    bottom.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def format_summary(
    rows: Sequence[StepRow],
    users: UserStatistics,
    events: PolicyEvents,
    *,
    health_policy_version: int,
    wall_s: float,
    live_s: float,
    files: Sequence[Path],
) -> str:
    """The end-of-run summary, as printed."""
    pauses_ms = [e.pause_s * 1e3 for e in events.applied]
    in_flight = [e.in_flight for e in events.applied]
    first, last = rows[0].result, rows[-1].result
    tail = [row.result.mean_reward for row in rows[-5:]]
    head = [row.result.mean_reward for row in rows[:5]]
    tokens = tokens_by_version(rows)
    versions = "  ".join(f"v{v}:{n}" for v, n in tokens.items())
    errors = [row.result.on_policy_error for row in rows if row.result.on_policy_error is not None]
    lines = [
        "",
        "online RL run: summary",
        f"  steps (policy updates published) {len(rows)}; wall time {wall_s:.0f} s, of which {live_s:.0f} s with "
        "users talking and the trainer training",
        f"  mean reward: first step {first.mean_reward:.3f}, last step {last.mean_reward:.3f} "
        f"(first 5 steps {np.mean(head):.3f}, last 5 steps {np.mean(tail):.3f})",
        f"  users: {users.sessions_started} sessions ({users.tool_sessions} offered a tool), "
        f"{users.sessions_rated} rated and closed, {users.turns_served} turns served "
        f"({users.streamed_turns} streamed)",
        f"  user-visible errors {users.errors}, aborted streams {users.aborted_streams}",
        f"  policy updates applied by the gateway: {len(events.applied)} (rejected {len(events.rejected)}), "
        f"/health policy_version {health_policy_version}",
        f"  decode pause per update: p50 {_percentile(pauses_ms, 50):.1f} ms, p99 {_percentile(pauses_ms, 99):.1f} ms, "
        f"max {max(pauses_ms, default=float('nan')):.1f} ms; requests in flight across a swap: "
        f"mean {np.mean(in_flight) if in_flight else 0:.1f}, max {max(in_flight, default=0)}",
        f"  replies whose tokens came from two versions (weights swapped mid-reply): "
        f"{sum(row.result.swapped_turns for row in rows)}",
        f"  recomputed vs recorded log-probs of tokens sampled by the trainer's own current version: "
        f"max |difference| {max(errors, default=float('nan')):.2g}",
        f"  sampled tokens trained on, by policy version: {versions}",
        f"  what users heard: first reply {users.first_reply[:60]!r}, last reply {users.last_reply[:60]!r}",
    ]
    lines += [f"  error: {m}" for m in users.error_messages]
    lines += [f"  rejected: v{e.rejected_version} {e.reason}: {e.detail}" for e in events.rejected]
    lines += [f"  wrote {path}" for path in files]
    return "\n".join(lines)
