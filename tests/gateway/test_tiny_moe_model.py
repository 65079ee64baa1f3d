"""tiny-moe: the Qwen3-MoE test model's build, its tokenizer (tiny's), and how decisively it routes.

Routing Replay records the experts each token was routed to and replays them; that only works if
an independent forward pass makes the same top-2 choice, so the routers must leave a clear gap
between the 2nd and 3rd logit. The model builds in well under a second (``scripts/test.sh``
prepares it before pytest starts anyway); what runs here is a few CPU forward passes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.models import MARKER_FILE, build_tiny_model, build_tiny_moe_model, resolve_model
from stream_gateway.models._tiny_moe import TINY_MOE_BUILDER_VERSION, build_tiny_moe

EXPERTS, TOP_K = 8, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return build_tiny_moe_model()


@pytest.fixture(scope="module")
def network(moe_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(moe_dir, local_files_only=True)
    return model.eval()


@pytest.fixture(scope="module")
def random_ids(network: Any) -> torch.Tensor:
    """200 sequences of 32 token ids drawn uniformly from the vocabulary (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, network.config.vocab_size, (200, 32), generator=generator)


@pytest.fixture(scope="module")
def router_logits(network: Any, random_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        logits: tuple[torch.Tensor, ...] = network(input_ids=random_ids, output_router_logits=True).router_logits
    return logits


def _top2(logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The chosen experts, ``[positions, layers, 2]``, each pair sorted (the order within is the weights')."""
    return torch.stack([layer.topk(TOP_K, dim=-1).indices.sort(dim=-1).values for layer in logits], dim=1)


def test_builds_resolves_and_is_all_moe(moe_dir: Path, network: Any) -> None:
    assert moe_dir.name == f"tiny-moe-v{TINY_MOE_BUILDER_VERSION}"
    assert json.loads((moe_dir / MARKER_FILE).read_text())["builder_version"] == TINY_MOE_BUILDER_VERSION
    assert resolve_model("tiny-moe") == str(moe_dir)
    config = network.config
    assert type(network).__name__ == "Qwen3MoeForCausalLM" and config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (EXPERTS, TOP_K) and config.norm_topk_prob
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [] and not config.output_router_logits
    assert config.num_hidden_layers in (2, 3)
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in network.model.layers)
    assert (config.hidden_size, config.head_dim, config.moe_intermediate_size) == (64, 32, 32)
    assert config.tie_word_embeddings and config.dtype == torch.float32
    tiny = json.loads((build_tiny_model() / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert getattr(config, key) == tiny[key], key
    assert config.rope_parameters == tiny["rope_parameters"]


def test_tokenizer_and_template_are_tinys(moe_dir: Path) -> None:
    tiny_dir = build_tiny_model()
    for name in TOKENIZER_FILES:
        assert (moe_dir / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "Read the README, héhé 🙂"}]
    tokenizers = [AutoTokenizer.from_pretrained(path, local_files_only=True) for path in (moe_dir, tiny_dir)]
    moe, tiny = (
        t.apply_chat_template(messages, tools=[tool], add_generation_prompt=True)["input_ids"] for t in tokenizers
    )
    assert moe == tiny and len(moe) > 20


def test_rebuild_is_byte_identical(moe_dir: Path, tmp_path: Path) -> None:
    build_tiny_moe(build_tiny_model(), tmp_path)
    built = sorted(p.name for p in moe_dir.iterdir() if p.name != MARKER_FILE)
    assert sorted(p.name for p in tmp_path.iterdir()) == built
    for name in built:
        assert (tmp_path / name).read_bytes() == (moe_dir / name).read_bytes(), name


def test_router_logits_one_tensor_per_layer(network: Any, random_ids: torch.Tensor, router_logits: Any) -> None:
    assert len(router_logits) == network.config.num_hidden_layers
    assert all(layer.shape == (random_ids.numel(), EXPERTS) for layer in router_logits)


def test_every_expert_is_used_in_every_layer(router_logits: tuple[torch.Tensor, ...]) -> None:
    chosen = _top2(router_logits)
    for layer in range(chosen.shape[1]):
        share = torch.bincount(chosen[:, layer].flatten(), minlength=EXPERTS) / chosen[:, layer].numel()
        assert share.min() > 0.05, (layer, share.tolist())  # measured: 0.10-0.16 each


def test_top2_choice_is_decisive(router_logits: tuple[torch.Tensor, ...]) -> None:
    top3 = torch.stack([layer.topk(3, dim=-1).values for layer in router_logits])
    gaps = top3[..., 1] - top3[..., 2]
    assert (gaps < 1e-4).float().mean() < 0.005  # measured: 1 of the 19,200 position-layers
    assert gaps.median() > 0.5  # measured: 2.2


def test_independent_passes_choose_the_same_experts(
    network: Any, random_ids: torch.Tensor, router_logits: tuple[torch.Tensor, ...]
) -> None:
    """One sequence alone, and prefilled half then decoded token by token, routes as the batch did."""
    batch, length = random_ids.shape
    recorded = _top2(router_logits).view(batch, length, -1, TOP_K)
    with torch.no_grad():
        for row in range(4):
            ids = random_ids[row : row + 1]
            alone = _top2(network(input_ids=ids, output_router_logits=True).router_logits)
            assert torch.equal(alone, recorded[row])
            step = network(input_ids=ids[:, : length // 2], use_cache=True, output_router_logits=True)
            replayed = [_top2(step.router_logits)]
            for t in range(length // 2, length):
                step = network(
                    input_ids=ids[:, t : t + 1],
                    past_key_values=step.past_key_values,
                    use_cache=True,
                    output_router_logits=True,
                )
                replayed.append(_top2(step.router_logits))
            assert torch.equal(torch.cat(replayed), recorded[row])
