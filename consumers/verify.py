"""Rollout-vs-trainer mismatch, measured at the source: ``stream-gateway verify``.

Every trainer now corrects for the difference between the logprobs the rollout engine sampled with
and the ones the trainer's forward pass computes (verl's rollout correction, truncated importance
sampling). This measures it on a batch before training: for a sample of its rows, a forward pass of
the given checkpoint (``transformers``, fp32 by default) over each row's ids gives the logprob of
every sampled id, compared with the recorded one:

* per row: max and mean ``|Δ|`` (Δ = recomputed - recorded, nats), the importance ratio
  ``r = exp(Δ)``'s spread (min, max), and the KL estimate ``mean(r - 1 - log r)`` (the "k3"
  estimator of KL(rollout || trainer) from samples of the rollout policy: unbiased, never negative);
* a row is flagged when its max ``|Δ|`` passes ``threshold``, or a sampled id has no finite logprob.

The positions compared are every sampled id (each turn's span, in the loss or not: a turn another
chain trains was still sampled with its logprob). Rows with images are skipped (the vision tower's
inputs are not in the batch file). ``temperature`` is the trainer's: the recorded logprobs are the
processed ones the engine sampled with (temperature and top-k/top-p applied), so a batch sampled at
another temperature shows that as mismatch, as the trainer would see it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .trajectory import Trajectory, has_logprob

__all__ = ["RowCheck", "VerifyReport", "verify_rows"]


@dataclass(frozen=True, slots=True)
class RowCheck:
    """One row's mismatch."""

    row: int
    trajectory_id: str
    sampled: int  # sampled ids compared
    max_abs_delta: float
    mean_abs_delta: float
    ratio_min: float
    ratio_max: float
    kl: float  # mean(r - 1 - log r), nats per sampled token
    missing: int  # sampled ids without a finite recorded logprob
    flagged: bool
    skipped: str | None = None  # why the row was not compared (images)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The rows checked and the batch's summary."""

    threshold: float
    temperature: float
    rows: list[RowCheck] = field(default_factory=list)

    @property
    def flagged(self) -> list[RowCheck]:
        return [r for r in self.rows if r.flagged]

    def summary(self) -> dict[str, Any]:
        compared = [r for r in self.rows if r.skipped is None and r.sampled]
        tokens = max(1, sum(r.sampled for r in compared))
        return {
            "rows_checked": len(compared),
            "rows_skipped": sum(r.skipped is not None for r in self.rows),
            "rows_flagged": len(self.flagged),
            "max_abs_delta": max((r.max_abs_delta for r in compared), default=0.0),
            "mean_abs_delta": sum(r.mean_abs_delta * r.sampled for r in compared) / tokens,
            "kl": sum(r.kl * r.sampled for r in compared) / tokens,
            "ratio_min": min((r.ratio_min for r in compared), default=1.0),
            "ratio_max": max((r.ratio_max for r in compared), default=1.0),
            "threshold": self.threshold,
            "temperature": self.temperature,
        }  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "rows": [asdict(r) for r in self.rows]}


def sampled_positions(trajectory: Trajectory) -> list[int]:
    """Every position of an id the engine sampled (each turn's span), in order."""
    out: list[int] = []
    for turn in trajectory.turns:
        out.extend(range(turn.start, min(turn.start + turn.length, len(trajectory.token_ids))))
    return out


def verify_rows(
    trajectories: Sequence[Trajectory],
    model: Any,
    *,
    rows: int | None = None,
    threshold: float = 0.05,
    temperature: float = 1.0,
    seed: int = 0,
) -> VerifyReport:
    """Recompute the sampled ids' logprobs of ``rows`` rows (all: ``None``) with ``model`` (a
    ``transformers`` causal LM) and compare (see the module docstring)."""
    import torch

    picked = list(range(len(trajectories)))
    if rows is not None and rows < len(picked):
        picked = sorted(random.Random(seed).sample(picked, rows))
    report = VerifyReport(threshold=threshold, temperature=temperature)
    device = next(model.parameters()).device
    for index in picked:
        trajectory = trajectories[index]
        positions = [p for p in sampled_positions(trajectory) if p > 0]
        if trajectory.images:
            report.rows.append(_skipped(index, trajectory, "images"))
            continue
        recorded = [trajectory.logprobs[p] for p in positions]
        missing = sum(not has_logprob(v) for v in recorded)
        ids = torch.tensor([trajectory.token_ids], device=device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0].float() / temperature
        at = torch.tensor([p - 1 for p in positions], device=device)
        chosen = torch.tensor([trajectory.token_ids[p] for p in positions], device=device)
        recomputed = torch.log_softmax(logits[at], -1).gather(1, chosen.unsqueeze(1)).squeeze(1).double().cpu()
        finite = torch.tensor([has_logprob(v) for v in recorded], dtype=torch.bool)
        delta = recomputed[finite] - torch.tensor(recorded, dtype=torch.float64)[finite]
        report.rows.append(_row(index, trajectory, delta, missing, threshold))
    return report


def _row(index: int, trajectory: Trajectory, delta: Any, missing: int, threshold: float) -> RowCheck:
    import torch

    if delta.numel() == 0:
        return RowCheck(index, trajectory.trajectory_id, 0, 0.0, 0.0, 1.0, 1.0, 0.0, missing, missing > 0)
    ratio = torch.exp(delta)
    magnitude = delta.abs()
    kl = float((ratio - 1 - delta).mean())
    worst = float(magnitude.max())
    return RowCheck(
        row=index, trajectory_id=trajectory.trajectory_id, sampled=int(delta.numel()), max_abs_delta=worst,
        mean_abs_delta=float(magnitude.mean()), ratio_min=float(ratio.min()), ratio_max=float(ratio.max()),
        kl=kl, missing=missing, flagged=worst > threshold or missing > 0,
    )  # fmt: skip


def _skipped(index: int, trajectory: Trajectory, why: str) -> RowCheck:
    return RowCheck(index, trajectory.trajectory_id, 0, 0.0, 0.0, 1.0, 1.0, 0.0, 0, False, skipped=why)
