"""Reasoning-related request fields on a model that does not think: clear 400s or documented
no-ops, never a 500 (docs/reasoning.md)."""

from __future__ import annotations

import httpx

from ..support.servers import RunningGateway


def test_thinking_knobs_a_model_lacks_are_clear_400s_or_documented_no_ops(gateway: RunningGateway) -> None:
    """On ``tiny`` (no thinking, no enable_thinking switch): what a request may not ask, it is told."""
    url, headers = gateway.base_url, {"authorization": "Bearer sk-r"}
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        bad = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": user,
                "max_tokens": 2,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text
        # reasoning_effort and Anthropic's thinking switch: accepted, no effect, on a model without the switch.
        ok = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": user, "max_tokens": 2, "reasoning_effort": "high"},
        )
        assert ok.status_code == 200, ok.text
        assert "reasoning_content" not in ok.json()["choices"][0]["message"]  # no parser: no thinking fields
        thinking_off = {"model": "tiny", "max_tokens": 2, "messages": user, "thinking": {"type": "disabled"}}
        assert http.post("/v1/messages", json=thinking_off).status_code == 200
        unsigned = {
            "model": "tiny",
            "max_tokens": 2,
            "messages": [
                *user,
                {
                    "role": "assistant",
                    "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "x"}],
                },
                {"role": "user", "content": "again"},
            ],
        }
        refused = http.post("/v1/messages", json=unsigned)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", refused.text
        assert "signature" in refused.json()["error"]["message"]
        redacted_block = {"type": "redacted_thinking", "data": "eA=="}
        assistant = {"role": "assistant", "content": [redacted_block, {"type": "text", "text": "x"}]}
        redacted = {**unsigned, "messages": [*user, assistant, {"role": "user", "content": "again"}]}
        assert http.post("/v1/messages", json=redacted).status_code == 200
