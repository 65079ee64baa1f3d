"""One tenant's trainer: online_rl's GRPO step (verl 0.9.1's own functions), on a LoRA adapter only.

:class:`LoraGrpoTrainer` is :class:`grpo_trainer.GrpoTrainer` with its model wrapped by PEFT:
the adapter's ``lora_A``/``lora_B`` are the only parameters that require a gradient and the only
ones Adam holds; the base model's weights are frozen (and :meth:`LoraGrpoTrainer.base_drift`
checks that they did not move). Each step is saved as a PEFT adapter directory
(``adapter_config.json``, ``adapter_model.safetensors``), which ``publish_policy(..., adapter=NAME)``
sends to the gateway as that adapter's next version.

Why ``lm_head`` is among the targets (besides the attention and MLP projections): the ``tiny``
model's output layer is its input embedding (tied), initialised with standard deviation 0.02, and
the last hidden state passes through an RMSNorm whose weight is 1, so it has norm sqrt(64) = 8.
A logit is the dot product of the two: whatever LoRA does to the layers before the norm, it moves
no logit by more than about 8 x 0.16 = 1.3 nats. No reward that needs a token class to become
likely is reachable that way (measured: with the seven projections alone, learning rates 3e-2 to
3e-1, the digit reward stayed at 0.001-0.003 for 40-60 steps). A LoRA on ``lm_head`` adds ``B A h``
to the logits and is not bound by the norm. The gateway's LoRA hooks serve it like any other
Linear (its logits equal PEFT's exactly); PEFT is told not to save the tied base weight beside
the adapter (``save_embedding_layers=False``): the adapter holds ``lora_A``/``lora_B`` only.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from grpo_trainer import GrpoTrainer

__all__ = ["ATTENTION_AND_MLP", "LoraGrpoTrainer", "make_initial_adapter"]

ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# PEFT warns that lm_head is tied to the embedding when an adapter targets it: the adapter's delta
# is added to lm_head's output only, and nothing here merges it into the (shared) base weight.
warnings.filterwarnings("ignore", message=r".*tie_word_embeddings=True.*", category=UserWarning)


def make_initial_adapter(
    model_dir: Path, directory: Path, *, rank: int, alpha: int, targets: tuple[str, ...], seed: int
) -> None:
    """A fresh PEFT LoRA adapter for the model in ``model_dir``, saved in ``directory``.

    PEFT's default initialisation: ``lora_A`` random (Kaiming-uniform), ``lora_B`` zero, so the
    adapter starts as the base model exactly. ``seed`` fixes ``lora_A``; the gateway loads this
    directory with ``--lora`` and the trainer starts from the same one.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none")
    model = get_peft_model(base, config)
    model.save_pretrained(str(directory), safe_serialization=True, save_embedding_layers=False)


class LoraGrpoTrainer(GrpoTrainer):
    """A local copy of the base with one tenant's adapter on it; each step trains the adapter alone."""

    def __init__(
        self,
        model_dir: Path,
        adapter_dir: Path,
        *,
        lr: float,
        group_size: int,
        batch_size: int,
        seed: int = 0,
        threads: int = 1,
    ) -> None:
        from peft import PeftModel

        super().__init__(model_dir, lr=lr, group_size=group_size, batch_size=batch_size, seed=seed, threads=threads)
        # The base the parent loaded, with the adapter on it: PEFT freezes every base parameter.
        self._model = PeftModel.from_pretrained(self._model, adapter_dir, is_trainable=True)  # type: ignore[assignment]
        self._model.train()
        trainable = {n: p for n, p in self._model.named_parameters() if p.requires_grad}
        if not trainable or any("lora_A" not in n and "lora_B" not in n for n in trainable):
            raise RuntimeError(f"expected only lora_A/lora_B to be trainable, got {sorted(trainable)[:5]}...")
        self.trainable_parameters = sum(p.numel() for p in trainable.values())
        self.base_parameters = sum(p.numel() for p in self._model.parameters() if not p.requires_grad)
        self._optimizer = torch.optim.Adam(list(trainable.values()), lr=lr)  # the adapter's tensors only
        self._base_at_start = {n: p.detach().clone() for n, p in self._model.named_parameters() if not p.requires_grad}

    def base_drift(self) -> float:
        """The largest change of any base weight since the start (0.0: the base is as loaded)."""
        now = dict(self._model.named_parameters())
        return max(float((now[n].detach() - before).abs().max()) for n, before in self._base_at_start.items())

    def save(self, directory: Path) -> None:
        """The adapter as a PEFT directory: ``adapter_config.json`` and ``adapter_model.safetensors``."""
        directory.mkdir(parents=True, exist_ok=True)
        self._model.save_pretrained(str(directory), safe_serialization=True, save_embedding_layers=False)
