"""Wire types of the chat completions request, validated strictly.

Unknown top-level fields are refused, as OpenAI does ("Unrecognized request argument"), so a
client never believes a parameter took effect when it did not. Known OpenAI parameters that
this gateway cannot honour are refused with ``unsupported_parameter`` unless they are set to
their no-op value. Parameters that change nothing about sampling (``user``, ``store``,
``metadata``...) are accepted and ignored; that list is :data:`IGNORED_PARAMETERS`.

``null`` on a top-level field means "not given" (OpenAI's spec marks nearly every optional
field nullable, and strict clients send them). The deprecated ``functions`` / ``function_call``
are translated to ``tools`` / ``tool_choice`` (and legacy ``function_call`` / ``function``
messages in the history to tool calls and tool results); the answer then uses the legacy shape.
docs/http-api.md has the table of every field.

Extensions, named as vLLM names them: ``return_token_ids``, ``top_k``, ``ignore_eos``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from stream_gateway._errors import InvalidRequest, UnsupportedParameter

IGNORED_PARAMETERS = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "parallel_tool_calls",
        "reasoning_effort",
        "verbosity",
        "prediction",  # predicted outputs only make a response faster, never different
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)

# Defined by OpenAI, refused unless null: they change the output or the response's shape.
UNSUPPORTED_UNLESS_NULL = {
    "audio": "audio output is not supported",
    "moderation": "moderation is not supported",
    "web_search_options": "web search is not supported",
}


def null_is_absent(data: Any) -> Any:
    """A request object without its ``null`` fields: OpenAI's spec makes them mean "not given"."""
    if isinstance(data, dict) and None in data.values():
        return {k: v for k, v in data.items() if v is not None}
    return data


MAX_STOP_SEQUENCES = 16
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOP_LOGPROBS = 20


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Wire):
    """A ``{"type": "text", "text": ...}`` content part."""

    type: Literal["text"]
    text: str
    # Anthropic-style cache hints that some clients attach to parts; they change nothing here.
    cache_control: dict[str, Any] | None = None


class ImageUrl(_Wire):
    """``image_url`` of an image part: a ``data:`` URL (or an ``http(s)`` one, see docs/images.md)."""

    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ImagePart(_Wire):
    """A ``{"type": "image_url", "image_url": {"url": ...}}`` content part (docs/images.md)."""

    type: Literal["image_url"]
    image_url: ImageUrl
    cache_control: dict[str, Any] | None = None


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Wire):
    """The function of an assistant tool call, as the client echoes it."""

    name: str
    arguments: str


class ToolCall(_Wire):
    """An assistant message's tool call."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message. Extra keys (``reasoning_content``, ``name``...) are kept but unused."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "assistant" and self.images():
            raise ValueError("assistant messages cannot carry images")
        return self

    def text(self) -> str:
        """The content as one string (parts concatenated; ``None`` as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts and their indices in ``content``."""
        if self.content is None or isinstance(self.content, str):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, ImagePart)]


class FunctionDefinition(_Wire):
    """A tool's function: name, description and JSON-schema parameters."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    """A tool the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Wire):
    """``stream_options``: only ``include_usage`` changes anything here."""

    include_usage: bool = False
    include_obfuscation: bool | None = None

    _nulls = model_validator(mode="before")(null_is_absent)


class ChatCompletionRequest(_Wire):
    """``POST /v1/chat/completions``."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, strict=True)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, strict=True)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # Accepted and ignored: they change nothing about what is sampled.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Refused unless null (UNSUPPORTED_UNLESS_NULL).
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Deprecated; translated to tools / tool_choice before validation (see _translate).
    functions: Annotated[list[FunctionDefinition], Field(min_length=1, max_length=128)] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    # vLLM extensions.
    return_token_ids: bool = False
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # The body's kept history (completion/_kept.py KeptHistory), set by the store that read it.
    _history: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _translate(cls, data: Any) -> Any:
        data = null_is_absent(data)
        if not isinstance(data, dict):
            return data
        for name, message in UNSUPPORTED_UNLESS_NULL.items():
            if name in data:
                raise UnsupportedParameter(message, param=name)
        tools = data.get("tools")
        if isinstance(tools, list):
            for tool in tools:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise UnsupportedParameter(
                        f"tools of type {kind!r} are not supported; only 'function'", param="tools"
                    )
        if "functions" in data or "function_call" in data:
            data = _from_legacy_functions(data)
        messages = data.get("messages")
        if isinstance(messages, list) and any(
            isinstance(m, dict) and ("function_call" in m or m.get("role") == "function") for m in messages
        ):
            data = {**data, "messages": _legacy_messages(messages)}
        return data

    @property
    def legacy_functions(self) -> bool:
        """Whether the request used ``functions``: the answer then carries ``function_call``."""
        return self.functions is not None

    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current name) or else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        """Refuse parameters that would change the output but that this gateway cannot honour."""
        if self.presence_penalty:
            raise UnsupportedParameter("presence_penalty is not supported", param="presence_penalty")
        if self.frequency_penalty:
            raise UnsupportedParameter("frequency_penalty is not supported", param="frequency_penalty")
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias is not supported", param="logit_bias")
        if self.modalities and set(self.modalities) != {"text"}:
            raise UnsupportedParameter("only the 'text' modality is supported", param="modalities")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise InvalidRequest("tool_choice is set but no tools are given", param="tool_choice")


def _from_legacy_functions(data: dict[str, Any]) -> dict[str, Any]:
    """``functions`` / ``function_call`` as ``tools`` / ``tool_choice`` (the legacy fields stay, for the answer)."""
    functions, choice = data.get("functions"), data.get("function_call")
    if functions is None:
        raise InvalidRequest("function_call is set but no functions are given", param="function_call")
    if "tools" in data or "tool_choice" in data:
        raise InvalidRequest(
            "Use either tools and tool_choice or functions and function_call, not both.", param="functions"
        )
    out = {**data}
    if isinstance(functions, list):
        out["tools"] = [{"type": "function", "function": f} for f in functions]
    if isinstance(choice, dict):
        out["tool_choice"] = {"type": "function", "function": choice}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _legacy_messages(messages: list[Any]) -> list[Any]:
    """History in the legacy shape: an assistant ``function_call`` becomes a tool call, a ``function``
    message its result (ids are made up: nothing compares them, see :mod:`._fingerprint`)."""
    out: list[Any] = []
    last_call: str | None = None
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        if message.get("role") == "assistant" and "function_call" in message:
            message = dict(message)
            call = message.pop("function_call")
            if call is not None and not message.get("tool_calls"):
                last_call = f"call_fn{position}"
                message["tool_calls"] = [{"id": last_call, "type": "function", "function": call}]
        elif message.get("role") == "function":
            message = {**message, "role": "tool", "tool_call_id": last_call or f"call_fn{position}"}
        out.append(message)
    return out
