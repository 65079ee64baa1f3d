"""A person's rating from the console: a number and a note on a trajectory or a turn, sent as feedback.

The console reads the durable stores and writes none of them itself: a rating goes to the gateway's
own feedback route (``POST /sessions/{id}/feedback``, docs/http-api.md) with the signed-in user's
key, as ``source: "console"`` and ``author`` the signed-in tenant. So it is one more
``feedback.recorded`` event, numbered in its session's events like any other (a replica holds the
session's ``seq`` blocks; an event the console published itself could collide with them), and what
follows is what follows any feedback: the assembler takes it into the session's trajectories, as a
revision when they were already emitted (docs/trajectories.md#rewards), and ``forget`` erases it
with the rest of the session.

Deliberate choices:

* **A trajectory is rated through its session.** Session feedback is every trajectory's reward of
  that session (the assembler's rule); a turn's rating is that turn's reward in each trajectory
  holding it. The console says so next to the form.
* **Tenant keys only.** The gateway scopes a session to the key that made it; an admin key is not
  that key, so an admin reads every tenant's sessions but rates none (403 ``tenant_key_needed``).
* The key stays in the console's memory for the login's lifetime (never in the browser); every call
  has a finite timeout and a gateway error comes back as the console's, with its status.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RatingBody", "RatingError", "send_rating"]

_TIMEOUT_S = 10.0


class RatingBody(BaseModel):
    """``POST /api/sessions/{id}/feedback``: a number, a note, and the turn it is about (none: the session)."""

    model_config = ConfigDict(extra="forbid")

    score: float = Field(strict=True, allow_inf_nan=False)
    note: str | None = Field(None, max_length=16_384)
    turn_id: str | None = Field(None, max_length=128)


class RatingError(Exception):
    """The gateway refused the rating or could not be reached: its status and message."""

    def __init__(self, status: int, message: str, code: str | None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


async def send_rating(gateway_url: str, key: str, session_id: str, rating: RatingBody, author: str) -> dict[str, Any]:
    """Send ``rating`` to the gateway's feedback route as ``author``; the feedback record it answers."""
    body = {"score": rating.score, "comment": rating.note, "turn_id": rating.turn_id, "source": "console",
            "author": author}  # fmt: skip
    url = f"{gateway_url.rstrip('/')}/sessions/{quote(session_id, safe='')}/feedback"
    try:
        async with httpx.AsyncClient(timeout=_TIMEOUT_S) as client:
            response = await client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
    except httpx.HTTPError as exc:
        raise RatingError(
            502, f"The gateway at {gateway_url} did not answer ({exc!r}).", "gateway_unavailable"
        ) from exc
    if response.status_code != 200:
        try:
            error = response.json()["error"]
            message, code = str(error["message"]), error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = f"The gateway answered {response.status_code}.", None
        raise RatingError(response.status_code, message, code)
    record: dict[str, Any] = response.json()
    return record
