"""``tiny-moe``: a tiny Qwen3-MoE model with seeded random weights and tiny's tokenizer.

Rollout Routing Replay (R3) records, per generated token, which experts each MoE layer routed it
to, so that training can replay the inference engine's choice; testing that capture needs a
mixture-of-experts model that builds in well under a second and runs on CPU. ``tiny-moe`` is
``tiny`` with its dense MLPs swapped for a sparse MoE block in every layer: a
``Qwen3MoeForCausalLM`` with 8 experts, top-2 routing (the top two renormalized), 3 layers (so
that a routing record of shape ``[positions, layers, top_k]`` is never square in its last two
axes), hidden size 64, 2 attention heads, 1 KV head (head size 32), tied embeddings, float32. Its tokenizer and
chat template are ``tiny``'s, byte for byte.

The weights are ``tiny``'s scheme (:func:`_seeded_init`: normal, std 0.02, from a private
generator with this module's seed), except the routers: at std 0.02 the median gap between a
position's 2nd and 3rd router logit is 0.05, under 1e-3 at 1.4% of positions and under 1e-4 at
0.1%, within the float noise between two forward passes (another batch, another kernel, another
engine, bf16), and a replay would disagree with the record for reasons that are not bugs. Each
router's weight is drawn again from the same generator with std :data:`_TINY_MOE_ROUTER_STD`: its
logits then spread over several units (hidden states enter the router RMS-normalized), the median
gap is about 2.2, and a gap under 1e-4 is a rare accident (1 of 57,600 position-layers over 400 random
sequences, where batch and single-sequence passes differ by 7e-6 at most), while every expert
still gets 10-16% of the choices in every layer.
``_registry.build_tiny_moe_model`` caches the result like every other model.
"""

from __future__ import annotations

from pathlib import Path

from stream_gateway.models._corpus import _save_chat_checkpoint
from stream_gateway.models._tiny import _chat_tokenizer, _seeded_init

__all__ = ["TINY_MOE_BUILDER_VERSION", "build_tiny_moe"]

TINY_MOE_BUILDER_VERSION = 2

_TINY_MOE_SEED = 20240604
_TINY_MOE_ROUTER_STD = 1.0  # of each router weight (mlp.gate.weight): decisive top-2 choices


def build_tiny_moe(tiny: Path, target: Path) -> None:
    """Save a seeded Qwen3-MoE model with ``tiny``'s tokenizer and template into ``target``.

    ``tiny``: the built ``tiny`` directory, whose tokenizer, chat template and token ids
    (bos, eos, pad) are reused unchanged.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Rebuilt from tiny's files as tiny's builder made it (not from_pretrained, whose loading
    # flags would end up in the saved tokenizer_config.json): the saved files are tiny's.
    backend = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer = _chat_tokenizer(backend, (tiny / "chat_template.jinja").read_text(encoding="utf-8"))
    tiny_config = AutoConfig.from_pretrained(tiny, local_files_only=True)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,  # of dense MLP layers, and there are none (mlp_only_layers)
        num_hidden_layers=3,
        num_attention_heads=2,  # head_dim 32, as tiny's (vLLM's CPU kernels)
        num_key_value_heads=1,
        head_dim=32,  # type: ignore[call-arg]  # not a declared field, but read (and saved) as one
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,  # every layer is MoE
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        max_position_embeddings=131072,
        rope_parameters=dict(tiny_config.rope_parameters),
        tie_word_embeddings=True,
        bos_token_id=tiny_config.bos_token_id,  # eos and pad: _save_chat_checkpoint, as tiny's
        dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config)  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(_TINY_MOE_SEED)
    _seeded_init(model, generator)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * _TINY_MOE_ROUTER_STD)
    _save_chat_checkpoint(model, tokenizer, target)
