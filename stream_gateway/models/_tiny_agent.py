"""tiny-agent's repertoire: the replies it was trained to give, as the template renders them back.

tiny-agent is ``tiny`` fine-tuned into an agent that really calls tools; its weights ship with the
package (``_shipped.py``), and its recipe lives outside it (``model_recipes/``, in the repository).
Its whole repertoire, sampled at any temperature up to 1.0: with its reading tool offered and a
user turn last it calls that tool on ``README.md`` (``agent_tool_call``; ``AGENT_TOOL_CALL`` for
``read``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``. The scripted engine and the tests
use these constants; the recipe trains on them.
"""

from __future__ import annotations

import json

from stream_gateway.models._corpus import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["AGENT_AFTER_TOOL", "AGENT_READERS", "AGENT_TOOL_CALL", "AGENT_WITHOUT_TOOLS", "agent_tool_call"]

# The file-reading tool each variant is trained to call, and how: ``tiny-agent``, pi's and
# OpenClaw's ``read``; ``tiny-agent-claude``, Claude Code's ``Read`` (a ``file_path`` relative to the
# working directory is accepted); ``tiny-agent-codex``, Codex's shell tool ``exec_command``. Each
# variant is the same recipe with only the name and the arguments of its call swapped: a model
# this small does not learn reliably to pick among several by the tools offered.
AGENT_READERS: dict[str, dict[str, str]] = {
    "read": {"path": "README.md"},
    "Read": {"file_path": "README.md"},
    "exec_command": {"cmd": "cat README.md"},
}


def agent_tool_call(reader: str = "read") -> str:
    """The variant's call of ``reader``, exactly as the template renders it back into the history."""
    body = json.dumps({"name": reader, "arguments": AGENT_READERS[reader]})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


# tiny-agent's three replies, each exactly as the template renders it back into the history.
AGENT_TOOL_CALL = agent_tool_call("read")
AGENT_AFTER_TOOL = "Done: I read the file."
AGENT_WITHOUT_TOOLS = "Hello from tiny-agent."
