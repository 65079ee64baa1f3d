"""One GRPO step per batch, with verl 0.9.1's own advantage and policy-loss functions, on CPU.

What verl's FSDP actor does for one mini-batch, without Ray or FSDP (neither runs without a GPU;
see the README): the batch in verl's padded layout (:func:`consumers.verl_batch.padded_batch`),
advantages from ``core_algos.compute_grpo_outcome_advantage`` over the rows' ``rm_scores`` grouped
by ``uid``, the current policy's log-probs of the response tokens from a forward pass, the clipped
PPO loss from ``core_algos.get_policy_loss_fn("vanilla")`` (aggregated by ``agg_loss``,
``token-mean``), configured by verl's own ``FSDPActorConfig``, with the gateway's recorded
``rollout_log_probs`` as the old log-probs, gradient clipping at the config's ``grad_clip``, then
one Adam step.

Deliberate differences from verl's trainer:

* The padding widths are the batch's own longest prompt and response, not the batcher's limits
  (1024/2048 by default): ``padded_batch`` only needs rows to fit, and a forward pass over 3072
  positions per row would be most of the step on CPU.
* No separate old-log-prob pass: the sampling log-probs the gateway recorded *are* the behaviour
  policy's (temperature 1.0, no top-k/top-p), including for tokens sampled by an older version
  while the trainer moved on; the PPO ratio and its clip handle that lag.
* ``on_policy_error`` checks the whole chain: for tokens sampled by the version the trainer holds
  right now, the recorded log-prob and the trainer's recomputed one should agree to float noise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from consumers.trajectory import Trajectory
from consumers.verl_batch import padded_batch

__all__ = ["GrpoTrainer", "StepResult", "dominant_version"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step saw and did."""

    mean_reward: float
    n_trajectories: int
    loss: float
    ppo_kl: float
    pg_clipfrac: float
    entropy: float
    grad_norm: float
    min_policy_version: int
    max_policy_version: int
    sampled_tokens: int
    tokens_per_version: dict[int, int]  # sampled tokens by the policy version that sampled them
    rewards_by_version: tuple[tuple[int, float], ...]  # (dominant version, reward) per trajectory
    on_policy_error: float | None  # max |recorded - recomputed| log-prob over tokens of the current version
    swapped_turns: int  # turns whose tokens came from more than one version (weights changed mid-reply)


def dominant_version(trajectory: Trajectory) -> int:
    """The policy version that sampled most of the trajectory's tokens."""
    versions = Counter(v for v, m in zip(trajectory.token_policy_versions(), trajectory.loss_mask, strict=True) if m)
    return versions.most_common(1)[0][0] if versions else trajectory.max_policy_version


class GrpoTrainer:
    """A local copy of the served model, trained one batch at a time (blocking: run it in a thread)."""

    def __init__(
        self, model_dir: Path, *, lr: float, group_size: int, batch_size: int, seed: int = 0, threads: int = 1
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from verl.trainer.ppo import core_algos
        from verl.workers.config import FSDPActorConfig

        torch.manual_seed(seed)
        torch.set_num_threads(threads)  # the gateway's engine decodes on the other core
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self._model.train()
        self._optimizer = torch.optim.Adam(self._model.parameters(), lr=lr)
        # verl's actor config: the vanilla loss reads clip_ratio(_low/_high), clip_ratio_c and
        # global_batch_info (empty: a single process aggregates over its own batch).
        self._config = FSDPActorConfig(
            strategy="fsdp",
            rollout_n=group_size,
            ppo_mini_batch_size=batch_size,
            ppo_micro_batch_size_per_gpu=batch_size,
            loss_agg_mode="token-mean",
        )
        loss_mode = self._config.policy_loss.get("loss_mode", "vanilla")
        self._policy_loss = core_algos.get_policy_loss_fn(loss_mode)  # type: ignore[no-untyped-call]
        self._grpo_advantage = core_algos.compute_grpo_outcome_advantage
        self._agg_loss = core_algos.agg_loss
        pad = self._tokenizer.pad_token_id
        self._pad_token_id = int(pad if pad is not None else self._tokenizer.eos_token_id)
        self.policy_version = 0  # the version of the weights held now (0: those the gateway started with)

    def step(self, trajectories: list[Trajectory], uids: list[str]) -> StepResult:
        """Train on one batch; afterwards the weights are ``policy_version + 1``."""
        from verl.utils.torch_functional import entropy_from_logits

        prompt_length = max(t.prompt_length for t in trajectories)
        response_length = max(t.response_length for t in trajectories)
        batch = padded_batch(
            trajectories,
            uids,
            prompt_length=prompt_length,
            response_length=response_length,
            pad_token_id=self._pad_token_id,
        )
        tensors = batch.tensors
        response_mask = tensors["response_mask"]
        advantages, _returns = self._grpo_advantage(
            token_level_rewards=tensors["rm_scores"],
            response_mask=response_mask,
            index=batch.non_tensors["uid"],
        )
        logits = self._model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
            use_cache=False,
        ).logits[:, prompt_length - 1 : -1]  # position t predicts token t + 1
        log_prob = torch.log_softmax(logits.float(), dim=-1).gather(-1, tensors["responses"].unsqueeze(-1)).squeeze(-1)
        loss, metrics = self._policy_loss(
            old_log_prob=tensors["rollout_log_probs"],
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask.bool(),
            loss_agg_mode=self._config.loss_agg_mode,
            config=self._config,
        )
        with torch.no_grad():
            entropy = self._agg_loss(
                loss_mat=entropy_from_logits(logits.detach()),
                loss_mask=response_mask,
                loss_agg_mode=self._config.loss_agg_mode,
            )
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._config.grad_clip)
        self._optimizer.step()

        versions = np.stack(list(batch.non_tensors["policy_versions"]))  # [B, R], -1 where not sampled
        sampled = response_mask.bool().numpy()
        current = versions == self.policy_version
        error = None
        if current.any():
            difference = (log_prob.detach() - tensors["rollout_log_probs"]).abs().numpy()
            error = float(difference[current & sampled].max())
        self.policy_version += 1
        counts = Counter(int(v) for v in versions[sampled])
        rewards = [0.0 if t.reward is None else t.reward for t in trajectories]
        return StepResult(
            mean_reward=float(np.mean(rewards)),
            n_trajectories=len(trajectories),
            loss=float(loss.item()),
            ppo_kl=float(metrics["actor/ppo_kl"]),
            pg_clipfrac=float(metrics["actor/pg_clipfrac"]),
            entropy=float(entropy.item()),
            grad_norm=float(grad_norm),
            min_policy_version=min(t.min_policy_version for t in trajectories),
            max_policy_version=max(t.max_policy_version for t in trajectories),
            sampled_tokens=int(sampled.sum()),
            tokens_per_version=dict(sorted(counts.items())),
            rewards_by_version=tuple((dominant_version(t), r) for t, r in zip(trajectories, rewards, strict=True)),
            on_policy_error=error,
            swapped_turns=sum(len(turn.policy_versions) > 1 for t in trajectories for turn in t.turns),
        )

    def save(self, directory: Path, *, untied: bool = False) -> None:
        """The weights as ``model.safetensors`` (Hugging Face names; tied tensors stored once, or,
        ``untied``, the output layer written out too, for servers that serve an untied copy)."""
        from safetensors.torch import save_file, save_model

        directory.mkdir(parents=True, exist_ok=True)
        if not untied:
            save_model(self._model, str(directory / "model.safetensors"))
            return
        state = {name: tensor.detach().clone().contiguous() for name, tensor in self._model.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"))
