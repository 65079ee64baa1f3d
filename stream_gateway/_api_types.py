"""Wire types of the chat completions request, validated strictly.

Unknown top-level fields are refused, as OpenAI does ("Unrecognized request argument"), so a
client never believes a parameter took effect when it did not. Known OpenAI parameters that
this gateway cannot honour are refused with ``unsupported_parameter`` unless they are set to
their no-op value. Parameters that change nothing about sampling (``user``, ``store``,
``metadata``...) are accepted and ignored; that list is :data:`IGNORED_PARAMETERS`.

Extensions, named as vLLM names them: ``return_token_ids``, ``top_k``, ``ignore_eos``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._errors import InvalidRequest, UnsupportedParameter

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
    }
)

MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Wire):
    """A ``{"type": "text", "text": ...}`` content part."""

    type: Literal["text"]
    text: str
    # Anthropic-style cache hints that some clients attach to parts; they change nothing here.
    cache_control: dict[str, Any] | None = None


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
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        """The content as one string (parts concatenated; ``None`` as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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


class ChatCompletionRequest(_Wire):
    """``POST /v1/chat/completions``."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
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
    # vLLM extensions.
    return_token_ids: bool = False
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False

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
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedParameter(
                f"response_format {self.response_format.get('type')!r} is not supported; only 'text'",
                param="response_format",
            )
        if self.modalities and set(self.modalities) != {"text"}:
            raise UnsupportedParameter("only the 'text' modality is supported", param="modalities")
        if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
            # Forcing a call needs constrained decoding, which the engines do not do yet.
            raise UnsupportedParameter(
                "tool_choice 'required' or a named function is not supported; use 'auto' or 'none'",
                param="tool_choice",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise InvalidRequest("tool_choice is set but no tools are given", param="tool_choice")
