"""The Responses API's request body (``POST /v1/responses``) as this gateway reads it.

Fields are typed where the gateway honours or echoes them; others are ignored (``extra="ignore"``:
Codex and other clients send fields for OpenAI's hosted features). What a strict client may send
that cannot be honoured is refused by name (:func:`refuse_unsupported`). The translation to a chat
request and the response objects are :mod:`._responses`'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from stream_gateway._errors import InvalidRequest

__all__ = ["FunctionTool", "ResponsesRequest", "TextConfig", "TextFormat", "refuse_unsupported"]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_In):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_In):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextConfig(_In):
    format: TextFormat | None = None


class ResponsesRequest(_In):
    model: str
    input: str | list[dict[str, Any]]
    # The body's kept history (completion/_kept.py KeptHistory), set by the store that read it.
    _history: Any = PrivateAttr(default=None)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, strict=True)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, strict=True)] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    # Echoed in the response object (strict clients validate it; they carry no sampling meaning here).
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    background: bool | None = None


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Fields a strict client may send that this gateway cannot honour: refused by name."""
    if body.background:
        raise InvalidRequest("background responses are not supported: stream the response instead.", param="background")
    if body.top_logprobs:
        raise InvalidRequest(
            "top_logprobs is not supported on /v1/responses (chat completions return them).", param="top_logprobs"
        )
