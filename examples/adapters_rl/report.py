"""The run's results: per-adapter step CSVs, every rating, the plot, the summary.

Rewards are measured where users see them: every rated session of every tenant is scored with
both rewards (:class:`tenants.Scorer`), so each tenant's replies have its own score and the other
tenant's. The adapter updates come from the gateway itself: ``policy.applied`` events with
``adapter`` on the ``SG_EVENTS`` stream (online_rl's :func:`run_report.read_policy_events`).
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from run_report import PolicyEvents, StepRow, write_csv
from simulated_users import UserStatistics
from tenants import ALPHA, BASE, BETA, Rating, Tenant

__all__ = ["AdapterRun", "format_summary", "write_csvs", "write_plot"]

_WINDOW = 32  # sessions: "first" and "last" are the means over a tenant's first and last this many ratings
_COLORS = {"digits": "tab:blue", "punctuation": "tab:orange"}


@dataclass(frozen=True, slots=True)
class AdapterRun:
    """What a run collected, for the report."""

    model: str
    targets: tuple[str, ...]
    rank: int
    rows: dict[str, list[StepRow]]  # by adapter
    ratings: dict[str, list[Rating]]  # by tenant name
    users: dict[str, UserStatistics]  # by tenant name
    tenants: dict[str, Tenant]
    events: PolicyEvents
    served_versions: dict[str, int]  # by adapter, as /v1/models shows them to its tenant at the end
    listed_models: dict[str, list[str]]  # by tenant name: what /v1/models lists to it
    foreign_requests: dict[str, int]  # by adapter: the HTTP status when tenant-base names it as its model
    base_policy_version: int  # /health at the end: the base model's version
    base_drift: dict[str, float]  # by adapter: the largest change of a base weight in its trainer
    trainable_parameters: int  # per adapter
    base_parameters: int
    live_s: float
    started_unix: float  # when the users started (for the gateway's event times)
    logs: tuple[Path, ...]

    @property
    def errors(self) -> int:
        """User-visible errors of every tenant."""
        return sum(u.errors for u in self.users.values())


def _other(tenant: Tenant) -> Tenant:
    return BETA if tenant is ALPHA else ALPHA


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def first_last(ratings: Sequence[Rating], reward: str, window: int = _WINDOW) -> tuple[float, float]:
    """The mean ``reward`` score of the first and of the last ``window`` rated sessions."""
    scores = [r.scores[reward] for r in ratings]
    return _mean(scores[:window]), _mean(scores[-window:])


def write_csvs(out: Path, run: AdapterRun) -> list[Path]:
    """``<adapter>.csv`` per adapter (online_rl's columns, one row per step) and ``ratings.csv``."""
    paths = []
    for adapter, rows in run.rows.items():
        path = out / f"{adapter}.csv"
        write_csv(path, rows)
        paths.append(path)
    path = out / "ratings.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(("tenant", "adapter", "t_s", "digits", "punctuation"))
        for name, ratings in run.ratings.items():
            adapter = run.tenants[name].adapter or ""
            for r in ratings:
                writer.writerow(
                    (name, adapter, f"{r.t:.2f}", f"{r.scores['digits']:.4f}", f"{r.scores['punctuation']:.4f}")
                )
    paths.append(path)
    return paths


def _binned(ratings: Sequence[Rating], reward: str, width: float, end: float) -> tuple[list[float], list[float]]:
    """Mean ``reward`` score of the sessions rated in each ``width``-second bin (centres; empty bins left out)."""
    edges = np.arange(0.0, end + width, width)
    times = np.array([r.t for r in ratings])
    scores = np.array([r.scores[reward] for r in ratings])
    centres, means = [], []
    for lo, hi in itertools.pairwise(edges):
        inside = (times >= lo) & (times < hi)
        if inside.any():
            centres.append(float((lo + hi) / 2))
            means.append(float(scores[inside].mean()))
    return centres, means


def write_plot(path: Path, run: AdapterRun, title: str) -> None:
    """Per tenant: its own reward and the other tenant's on its replies over time; below, the adapter versions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((r.t for ratings in run.ratings.values() for r in ratings), default=1.0)
    width = max(3.0, round(end / 30))
    fig, axes = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True, height_ratios=(2, 2, 1.2))
    base = run.ratings.get(BASE.name, [])
    for ax, tenant in zip(axes[:2], (ALPHA, BETA), strict=True):
        ratings, other = run.ratings[tenant.name], _other(tenant)
        own, cross = tenant.rewards, other.rewards
        ax.plot(*_binned(ratings, own, width, end), "o-", ms=4, color=_COLORS[own], label=f"{own} (its own reward)")
        steps = run.rows[str(tenant.adapter)]
        ax.plot(
            [s.elapsed_s for s in steps],
            [s.result.mean_reward for s in steps],
            ".",
            ms=4,
            alpha=0.5,
            color=_COLORS[own],
            label=f"{own}: mean of the batch trained at each step",
        )
        ax.plot(
            *_binned(ratings, cross, width, end),
            "s--",
            ms=4,
            color=_COLORS[cross],
            label=f"{cross} ({other.name}'s reward) on the same replies: leakage",
        )
        if base:
            ax.plot(
                *_binned(base, own, width, end),
                ":",
                color="0.45",
                label=f"{own} on the base model's replies ({BASE.name}, the control)",
            )
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("mean score of the\nsessions rated")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small", title=f"{tenant.name}'s replies (adapter {tenant.adapter}):")
    axes[0].set_title(title, fontsize="medium")
    bottom = axes[2]
    for tenant in (ALPHA, BETA):
        applied = sorted(
            (e.time - run.started_unix, e.policy_version) for e in run.events.applied if e.adapter == tenant.adapter
        )
        if applied:
            times, versions = zip(*applied, strict=True)
            bottom.step(
                [0.0, *times, end],
                [0, *versions, versions[-1]],
                where="post",
                color=_COLORS[tenant.rewards],
                label=f"adapter {tenant.adapter}",
            )
    bottom.set_ylabel("version in service\n(policy.applied)")
    bottom.set_xlabel(f"seconds since the users started (ratings averaged over {width:g} s bins)")
    bottom.grid(alpha=0.3)
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def format_summary(run: AdapterRun, *, wall_s: float, files: Sequence[Path]) -> str:
    """The end-of-run summary, as printed."""
    lines = [
        "",
        "per-tenant LoRA adapters, trained online: summary",
        f"  one base ({run.model}, {run.base_parameters / 1e3:.0f} k parameters, frozen) and two adapters, LoRA r "
        f"{run.rank} on {','.join(run.targets)} ({run.trainable_parameters / 1e3:.1f} k parameters each); "
        f"wall time {wall_s:.0f} s, of which {run.live_s:.0f} s with users talking and the trainers training",
        f"  first/last: the mean score of a tenant's first and last {_WINDOW} rated sessions",
    ]
    for tenant in (ALPHA, BETA):
        rows, ratings, other = run.rows[str(tenant.adapter)], run.ratings[tenant.name], _other(tenant)
        own_first, own_last = first_last(ratings, tenant.rewards)
        cross_first, cross_last = first_last(ratings, other.rewards)
        batch = [r.result.mean_reward for r in rows]
        lines += [
            f"  {tenant.name} (adapter {tenant.adapter}; its users reward {tenant.rewards}): {len(rows)} steps, "
            f"{len(ratings)} sessions rated",
            f"    own reward ({tenant.rewards}):  first {own_first:.3f}  last {own_last:.3f}   "
            f"(batch trained: first step {batch[0] if batch else float('nan'):.3f}, last step "
            f"{batch[-1] if batch else float('nan'):.3f})",
            f"    cross ({other.name}'s reward, {other.rewards}, on {tenant.name}'s replies):  "
            f"first {cross_first:.3f}  last {cross_last:.3f}",
        ]
    if BASE.name in run.ratings:
        ratings = run.ratings[BASE.name]
        digits, punctuation = first_last(ratings, "digits"), first_last(ratings, "punctuation")
        lines.append(
            f"  {BASE.name} (no adapter: the base model; control, {len(ratings)} sessions rated): "
            f"digits first {digits[0]:.3f} last {digits[1]:.3f}, punctuation first {punctuation[0]:.3f} "
            f"last {punctuation[1]:.3f}"
        )
    users = run.users.values()
    by_tenant = ", ".join(f"{name} {u.errors}" for name, u in run.users.items())
    lines += [
        f"  user-visible errors {run.errors} ({by_tenant}), aborted streams {sum(u.aborted_streams for u in users)}; "
        f"{sum(u.sessions_rated for u in users)} sessions rated and closed, {sum(u.turns_served for u in users)} "
        "turns served",
    ]
    applied = {t.adapter: [e for e in run.events.applied if e.adapter == t.adapter] for t in (ALPHA, BETA)}
    rejected = {t.adapter: sum(e.adapter == t.adapter for e in run.events.rejected) for t in (ALPHA, BETA)}
    base_applied = sum(e.adapter is None for e in run.events.applied)
    lines.append(
        "  adapter updates applied by the gateway (policy.applied with adapter=NAME): "
        + ", ".join(f"{a} {len(applied[a])} (rejected {rejected[a]})" for a in applied)
        + "; /v1/models at the end: "
        + ", ".join(f"{a} v{v}" for a, v in sorted(run.served_versions.items()))
        + f"; base model updates applied {base_applied}, /health policy_version {run.base_policy_version}"
    )
    lines.append(
        "  isolation: /v1/models lists "
        + "; ".join(f"{name}: {', '.join(models)}" for name, models in run.listed_models.items())
        + f"; {BASE.name} naming an adapter as its model: "
        + ", ".join(f"{a} -> {status}" for a, status in run.foreign_requests.items())
    )
    pauses = [e.pause_s * 1e3 for events in applied.values() for e in events]
    lines.append(
        f"  decode pause per adapter update: p50 {_percentile(pauses, 50):.1f} ms, "
        f"p99 {_percentile(pauses, 99):.1f} ms, max {max(pauses, default=float('nan')):.1f} ms"
    )
    errors = {
        a: max((r.result.on_policy_error for r in rows if r.result.on_policy_error is not None), default=float("nan"))
        for a, rows in run.rows.items()
    }
    lines += [
        "  recomputed (PEFT, in the trainer) vs recorded (the gateway's LoRA hooks) log-probs of tokens sampled by the "
        "trainer's current version: max |difference| " + ", ".join(f"{a} {e:.2g}" for a, e in errors.items()),
        "  base weights moved by the trainers: max |change| "
        + ", ".join(f"{a} {d:g}" for a, d in run.base_drift.items()),
        "  what users heard last: " + ", ".join(f"{name} {u.last_reply[:40]!r}" for name, u in run.users.items()),
    ]
    for name, u in run.users.items():
        lines += [f"  error ({name}): {m}" for m in u.error_messages]
    lines += [f"  rejected: {e.adapter} v{e.rejected_version} {e.reason}: {e.detail}" for e in run.events.rejected]
    lines += [f"  wrote {path}" for path in files]
    return "\n".join(lines)
