"""The protocol-neutral core: a canonical request in, a token-exact turn and its output out.

The request's path through it: :class:`Admission` (model, ``n``, sizes, context length, sampling
defaults) → :class:`Preparer` (the session it continues, the prompt the chat template renders
around the reused ids: :mod:`._context`, :mod:`._prompt`, :mod:`._fingerprint`; what an earlier
request of the conversation left, so a continuation reads and renders only what it adds:
:mod:`._history`, :mod:`._kept`, :mod:`._replay`) →
:class:`CompletionService` (one engine request per choice; the token loop assembles text
(:mod:`._text`) and tool calls into :class:`ChoiceUpdate` objects; the service decides how a
response is produced: a one-choice stream written frame by frame through the HTTP layer's
:class:`FrameWriter`, from the engine's I/O callbacks where it pushes; several choices through an
:class:`UpdateChannel`, and hands the HTTP layer a :class:`StreamOutput` to send) → a protocol's
:class:`FrameEncoder` or a whole body. Beside the loop, :class:`TurnLifecycle` records the turn:
events, metrics, spend, the session tree.
"""

from stream_gateway.completion._admission import Admission, SamplingRequest
from stream_gateway.completion._channel import UpdateChannel, coalesce, fold_tool_calls
from stream_gateway.completion._context import Context, ContextBuilder
from stream_gateway.completion._fingerprint import (
    assistant_fingerprint,
    conversation_keys,
    extend_key,
    message_fingerprint,
    prefix_keys,
    tools_fingerprint,
)
from stream_gateway.completion._history import Histories, HistoryStatistics
from stream_gateway.completion._kept import KeptHistory
from stream_gateway.completion._prepare import PreparedCompletion, Preparer, TokenInRequest
from stream_gateway.completion._prompt import template_message
from stream_gateway.completion._request import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    Message,
    StreamOptions,
    Tool,
    null_is_absent,
)
from stream_gateway.completion._service import (
    CompletionService,
    FrameEncoder,
    FrameWriter,
    StreamOutput,
    TokenText,
)
from stream_gateway.completion._template import ChatTemplate
from stream_gateway.completion._text import TextAssembler
from stream_gateway.completion._turn import Spend, TurnLifecycle, Turns
from stream_gateway.completion._updates import ChoiceResult, ChoiceUpdate

__all__ = [
    "Admission",
    "ChatCompletionRequest",
    "ChatTemplate",
    "ChoiceResult",
    "ChoiceUpdate",
    "CompletionService",
    "Context",
    "ContextBuilder",
    "FrameEncoder",
    "FrameWriter",
    "Histories",
    "HistoryStatistics",
    "KeptHistory",
    "MAX_STOP_SEQUENCES",
    "Message",
    "PreparedCompletion",
    "Preparer",
    "SamplingRequest",
    "Spend",
    "StreamOptions",
    "StreamOutput",
    "TextAssembler",
    "TokenInRequest",
    "TokenText",
    "Tool",
    "TurnLifecycle",
    "Turns",
    "UpdateChannel",
    "assistant_fingerprint",
    "coalesce",
    "conversation_keys",
    "extend_key",
    "fold_tool_calls",
    "message_fingerprint",
    "null_is_absent",
    "prefix_keys",
    "template_message",
    "tools_fingerprint",
]
