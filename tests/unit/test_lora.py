"""Per-row LoRA adapters (stream_gateway.lora) on a tiny Qwen2, against PEFT as the reference.

The base model is built here from a config with seeded random weights (no built model on disk).
Two adapters are made with PEFT (``get_peft_model`` / ``add_adapter``), their lora_B drawn from a
seeded generator (PEFT initialises it to zero, which would make every adapter the base), and saved
with ``save_pretrained``; the PEFT model holding them computes the expected logits, one row alone at a
time with its adapter active. PEFT is not a dependency of the package, only of its tests (the
``test`` extra).
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from stream_gateway._errors import AdapterRefused
from stream_gateway.lora import LoraBank, LoraWeights, adapter_from_tensors, read_adapter

VOCAB = 200
ATOL = 1e-5
PREFIX = "base_model.model."
# Adapter qv: rsLoRA on attention queries and values. Adapter wide: more modules, a rank and an alpha
# pattern (o_proj at rank 2, gate_proj at alpha 32).
CONFIG_A: dict[str, Any] = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}
CONFIG_B: dict[str, Any] = {
    "r": 8,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj"],
    "rank_pattern": {"o_proj": 2},
    "alpha_pattern": {"gate_proj": 32},
}
PROMPTS = ((5, 17, 3, 99, 42, 7, 150), (8, 64, 12, 190), (33, 1, 77, 120, 9, 61))  # rows of lengths 7, 4, 6


def _base() -> Qwen2ForCausalLM:
    """The tiny base, the same weights on every call."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return Qwen2ForCausalLM(config).eval()


def _randomize(model: torch.nn.Module, adapter: str, seed: int) -> None:
    """Draw the adapter's lora_A and lora_B (B is zero after PEFT's default initialisation)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f".lora_A.{adapter}." in name or f".lora_B.{adapter}." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The PEFT model holding adapters ``qv`` and ``wide``, saved under ``.saved`` (``saved/qv``, ``saved/wide``)."""
    import peft

    model = peft.get_peft_model(_base(), peft.LoraConfig(**CONFIG_A), adapter_name="qv")
    model.add_adapter("wide", peft.LoraConfig(**CONFIG_B))
    _randomize(model, "qv", seed=1)
    _randomize(model, "wide", seed=2)
    model.eval()
    saved = tmp_path_factory.mktemp("adapters")
    model.save_pretrained(saved)  # adapters not named "default" go to subfolders
    model.saved = saved
    return model


@pytest.fixture
def bank(peft_model: Any) -> Iterator[tuple[Qwen2ForCausalLM, LoraBank]]:
    """A fresh copy of the base with ``qv`` and ``wide`` read from disk and loaded."""
    model = _base()
    bank = LoraBank(model)
    bank.load("qv", read_adapter(peft_model.saved / "qv"))
    bank.load("wide", read_adapter(peft_model.saved / "wide"))
    yield model, bank
    bank.detach()


def _reference(peft_model: Any, adapter: str | None, prompt: tuple[int, ...]) -> torch.Tensor:
    """PEFT's logits [len, vocab] for one row alone, with ``adapter`` active (None: adapters disabled)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(input_ids=ids).logits[0]
        peft_model.set_adapter(adapter)
        return peft_model(input_ids=ids).logits[0]


def _padded(prompts: tuple[tuple[int, ...], ...]) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def _batch_logits(model: Qwen2ForCausalLM, prompts: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """Each row's logits at its real positions, from one left-padded forward."""
    with torch.no_grad():
        logits = model(**_padded(prompts)).logits
    return [logits[row, logits.shape[1] - len(prompt) :] for row, prompt in enumerate(prompts)]


# -- applying adapters per row -------------------------------------------------------------------


def test_a_mixed_left_padded_batch_matches_each_row_alone_under_peft(
    peft_model: Any, bank: tuple[Qwen2ForCausalLM, LoraBank]
) -> None:
    model, lora = bank
    adapters = ("qv", "wide", None)
    with lora.rows(adapters):
        rows = _batch_logits(model, PROMPTS)
    for adapter, prompt, logits in zip(adapters, PROMPTS, rows, strict=True):
        expected = _reference(peft_model, adapter, prompt)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # The adapters do change the logits (a test of nothing otherwise), and differ from each other.
    base = _reference(peft_model, None, PROMPTS[0])
    assert (_reference(peft_model, "qv", PROMPTS[0]) - base).abs().max() > 0.05
    assert (_reference(peft_model, "wide", PROMPTS[0]) - base).abs().max() > 0.05
    # One row on one adapter: the group covers the batch (no gather), as in a prefill [1, P].
    for adapter in ("qv", "wide"):
        with lora.rows([adapter]):
            (alone,) = _batch_logits(model, (PROMPTS[1],))
        torch.testing.assert_close(alone, _reference(peft_model, adapter, PROMPTS[1]), atol=ATOL, rtol=0)
    # Back on the base after the block: the hooks stay, and add nothing.
    (plain,) = _batch_logits(model, (PROMPTS[2],))
    torch.testing.assert_close(plain, _reference(peft_model, None, PROMPTS[2]), atol=ATOL, rtol=0)


def test_incremental_decode_keeps_each_rows_adapter(bank: tuple[Qwen2ForCausalLM, LoraBank]) -> None:
    """A padded prefill [rows, width], then decode steps [rows, 1] on a DynamicCache, as the engine
    does; each step's logits equal a full forward over the sequences so far. Rows prefilled alone
    ([1, P]) agree with the batched prefill."""
    model, lora = bank
    adapters = ["wide", None, "qv", "wide"]
    prompts = (*PROMPTS, PROMPTS[0][2:])
    sequences = [list(prompt) for prompt in prompts]
    inputs = _padded(prompts)
    mask = inputs["attention_mask"]
    cache = DynamicCache()
    lora.set_rows(adapters)
    with torch.no_grad():
        out = model(**inputs, past_key_values=cache, use_cache=True)
        for _ in range(4):
            tokens = out.logits[:, -1].argmax(-1)
            for sequence, token in zip(sequences, tokens.tolist(), strict=True):
                sequence.append(token)
            mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=torch.tensor([[len(s) - 1] for s in sequences]),
                past_key_values=cache,
                use_cache=True,
            )
            full = _batch_logits(model, tuple(tuple(s) for s in sequences))
            torch.testing.assert_close(out.logits[:, -1], torch.stack([f[-1] for f in full]), atol=ATOL, rtol=0)
    batched = _batch_logits(model, prompts)
    for adapter, prompt, logits in zip(adapters, prompts, batched, strict=True):
        with lora.rows([adapter]):
            (alone,) = _batch_logits(model, (prompt,))
        torch.testing.assert_close(alone, logits, atol=ATOL, rtol=0)


def test_a_new_version_changes_its_rows_only(
    peft_model: Any, bank: tuple[Qwen2ForCausalLM, LoraBank], tmp_path: Path
) -> None:
    model, lora = bank
    adapters = ("qv", "wide", None)
    with lora.rows(adapters):
        before = _batch_logits(model, PROMPTS)
    # Version 2 of qv: its lora_B negated and one module left out, saved as PEFT saves.
    shutil.copy(peft_model.saved / "qv" / "adapter_config.json", tmp_path / "adapter_config.json")
    tensors = load_file(peft_model.saved / "qv" / "adapter_model.safetensors")
    tensors = {k: -v if ".lora_B." in k else v for k, v in tensors.items() if ".layers.1.self_attn.v_proj." not in k}
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    lora.set_rows(adapters)
    lora.load("qv", read_adapter(tmp_path))  # between two forwards, the rows as they were
    after = _batch_logits(model, PROMPTS)
    lora.set_rows(())
    assert lora.names() == ["qv", "wide"]
    assert (after[0] - before[0]).abs().max() > 0.05
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    with warnings.catch_warnings():
        # The left-out module is the point: peft 0.22 warns of it (0.21 did not), as the gateway does not.
        warnings.filterwarnings("ignore", message="Found missing adapter keys", category=UserWarning)
        peft_model.load_adapter(tmp_path, adapter_name="qv2")
    try:
        torch.testing.assert_close(after[0], _reference(peft_model, "qv2", PROMPTS[0]), atol=ATOL, rtol=0)
    finally:
        peft_model.set_adapter("qv")  # deleting the active adapter warns
        peft_model.delete_adapter("qv2")


def test_unload_set_rows_and_batch_checks(bank: tuple[Qwen2ForCausalLM, LoraBank]) -> None:
    model, lora = bank
    with pytest.raises(KeyError, match="not loaded"):
        lora.set_rows(["qv", "c"])
    lora.set_rows(["qv", "wide", None])
    with pytest.raises(ValueError, match="forward over 2 rows"):
        _batch_logits(model, PROMPTS[:2])
    lora.unload("wide")  # its row falls back to the base; qv's row keeps qv
    assert lora.names() == ["qv"]
    rows = _batch_logits(model, PROMPTS)
    lora.set_rows(())
    (plain,) = _batch_logits(_base(), (PROMPTS[1],))  # an identical base, never hooked
    torch.testing.assert_close(rows[1], plain, atol=ATOL, rtol=0)
    with lora.rows(["qv"]):
        (alone,) = _batch_logits(model, (PROMPTS[0],))
    torch.testing.assert_close(rows[0], alone, atol=ATOL, rtol=0)
    with pytest.raises(KeyError):
        lora.unload("wide")
    lora.detach()
    assert lora.names() == []
    assert not any(m._forward_hooks for m in model.modules())


# -- reading and refusing ------------------------------------------------------------------------


def test_reading_agrees_with_peft_and_adapter_from_tensors(peft_model: Any) -> None:
    """The scalings PEFT computed (rank/alpha patterns, rsLoRA) and the weights it holds; the same
    adapter from its config dict and state dict."""
    for adapter, config in (("qv", CONFIG_A), ("wide", CONFIG_B)):
        directory = peft_model.saved / adapter
        weights = read_adapter(directory)
        assert weights.target_modules == frozenset(config["target_modules"])
        assert weights.rank == config["r"]
        layers = {n: m for n, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A")}
        expected = {n for n, m in layers.items() if adapter in m.lora_A}
        assert set(weights.modules) == expected
        for name, (a, b, scaling) in weights.modules.items():
            layer = layers[name]
            assert scaling == pytest.approx(layer.scaling[adapter])
            assert torch.equal(a, layer.lora_A[adapter].weight) and torch.equal(b, layer.lora_B[adapter].weight)
        again = adapter_from_tensors(
            json.loads((directory / "adapter_config.json").read_text()),
            load_file(directory / "adapter_model.safetensors"),
        )
        assert (again.rank, again.target_modules) == (weights.rank, weights.target_modules)
        assert again.modules.keys() == weights.modules.keys()
        for name, (a, b, scaling) in weights.modules.items():
            a2, b2, scaling2 = again.modules[name]
            assert torch.equal(a, a2) and torch.equal(b, b2) and scaling == scaling2
    wide = read_adapter(peft_model.saved / "wide")
    assert wide.modules["model.layers.0.self_attn.o_proj"][2] == 8 / 2  # rank_pattern: alpha / 2
    assert wide.modules["model.layers.0.mlp.gate_proj"][2] == 32 / 8  # alpha_pattern: 32 / r
    assert read_adapter(peft_model.saved / "qv").modules["model.layers.1.self_attn.q_proj"][2] == 16 / math.sqrt(4)


def _tensors(module: str, r: int = 4, in_features: int = 64, out_features: int = 64) -> dict[str, torch.Tensor]:
    return {
        f"{PREFIX}{module}.lora_A.weight": torch.randn(r, in_features),
        f"{PREFIX}{module}.lora_B.weight": torch.randn(out_features, r),
    }


@pytest.mark.parametrize(
    ("module", "r", "in_features", "out_features", "reason"),
    [
        ("model.layers.0.self_attn.nonexistent_proj", 4, 64, 64, "target_mismatch"),
        ("model.layers.0.input_layernorm", 4, 64, 64, "target_mismatch"),  # there, but not a Linear
        ("model.layers.0.self_attn.q_proj", 4, 32, 64, "shape_mismatch"),  # A's in_features
        ("model.layers.0.self_attn.k_proj", 4, 64, 64, "shape_mismatch"),  # k_proj's out_features are 32
    ],
)
def test_load_refuses_what_the_base_cannot_take(
    module: str, r: int, in_features: int, out_features: int, reason: str
) -> None:
    model = _base()
    lora = LoraBank(model)
    good = adapter_from_tensors({"r": 4, "lora_alpha": 8}, _tensors("model.layers.1.self_attn.q_proj"))
    lora.load("x", good)
    bad = {**_tensors(module, r, in_features, out_features), **_tensors("model.layers.0.self_attn.v_proj", 4, 64, 32)}
    with pytest.raises(AdapterRefused, match=module.rsplit(".", 1)[-1]) as refused:
        lora.load("x", adapter_from_tensors({"r": 4, "lora_alpha": 8}, bad))
    assert refused.value.reason == reason
    assert lora._adapters == {"x": frozenset({"model.layers.1.self_attn.q_proj"})}  # a refused load changes nothing
    assert set(lora._handles) == {"model.layers.1.self_attn.q_proj"}


def test_too_many_adapters() -> None:
    lora = LoraBank(_base(), max_adapters=2)
    weights = adapter_from_tensors({"r": 4}, _tensors("model.layers.0.self_attn.q_proj"))
    lora.load("x", weights)
    lora.load("y", weights)
    with pytest.raises(AdapterRefused) as refused:
        lora.load("z", weights)
    assert refused.value.reason == "too_many"
    lora.load("y", weights)  # a new version of a loaded name is no new adapter
    lora.unload("x")
    lora.load("z", weights)
    assert lora.names() == ["y", "z"]


@pytest.mark.parametrize(
    "change",
    [
        {"bias": "all"},
        {"bias": "lora_only"},
        {"use_dora": True},
        {"modules_to_save": ["lm_head"]},
        {"fan_in_fan_out": True},
        {"lora_bias": True},
        {"init_lora_weights": "pissa"},
        {"init_lora_weights": "olora"},
        {"alora_invocation_tokens": [5, 6]},
        {"peft_type": "LOHA"},
    ],
)
def test_unsupported_configs(peft_model: Any, tmp_path: Path, change: dict[str, Any]) -> None:
    shutil.copy(peft_model.saved / "qv" / "adapter_model.safetensors", tmp_path)
    config = json.loads((peft_model.saved / "qv" / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterRefused) as refused:
        read_adapter(tmp_path)
    assert refused.value.reason == "unsupported"
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize(
    ("tensors", "config", "reason", "match"),
    [
        ({f"{PREFIX}model.embed_tokens.lora_embedding_A": torch.zeros(4, 200)}, {}, "unsupported", "lora_embedding_A"),
        ({f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, {}, "unreadable", "missing"),
        (_tensors("model.layers.0.self_attn.q_proj", r=4), {"r": 8}, "unreadable", "rank 8"),
        (_tensors("model.layers.0.self_attn.q_proj", r=4), {"r": "4"}, "unreadable", "positive int"),
        ({}, {}, "unreadable", "no LoRA weights"),
    ],
)
def test_malformed_state_dicts(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], reason: str, match: str
) -> None:
    with pytest.raises(AdapterRefused, match=match) as refused:
        adapter_from_tensors({"r": 4, "lora_alpha": 8, **config}, tensors)
    assert refused.value.reason == reason


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    def reason() -> str:
        with pytest.raises(AdapterRefused) as refused:
            read_adapter(tmp_path)
        return refused.value.reason

    assert reason() == "unreadable"  # nothing there
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert reason() == "unreadable"
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    assert reason() == "unreadable"  # no weights
    (tmp_path / "adapter_model.bin").write_bytes(b"pickled")
    assert reason() == "unsupported"  # pickled weights alone are never read
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage-not-a-header")
    assert reason() == "unreadable"
    save_file(_tensors("model.layers.0.self_attn.q_proj"), tmp_path / "adapter_model.safetensors")
    weights = read_adapter(tmp_path)
    assert isinstance(weights, LoraWeights)
    assert weights.target_modules == {"q_proj"}  # none declared: the modules present
