"""The real agents, installed from npm, complete one turn against the tiny-model gateway.

The tiny model emits random text, so these check only that each agent reached the gateway with
a streaming request the gateway accepted, and that the agent finished cleanly on the answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..support.agents import ensure_agents_installed, openclaw_texts, run_openclaw, run_pi
from ..support.servers import RunningGateway

# Installing the agents (about a minute, once per machine) counts against the first test.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def agents() -> Iterator[Path]:
    """The agents installed (cached across runs) by scripts/install_agents.sh."""
    yield ensure_agents_installed()


def _requests_by_outcome(gateway: RunningGateway) -> Counter[tuple[str, str]]:
    """``gateway_requests_total`` by (stream, status), from ``GET /metrics``."""
    response = httpx.get(gateway.base_url + "/metrics", timeout=10)
    response.raise_for_status()
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "gateway_requests_total":
                counts[sample.labels["stream"], sample.labels["status"]] += int(sample.value)
    return counts


def _new_requests(before: Counter[tuple[str, str]], after: Counter[tuple[str, str]]) -> Counter[tuple[str, str]]:
    after = after.copy()
    after.subtract(before)
    return +after


def test_pi_completes_a_turn_through_the_gateway(agents: Path, gateway: RunningGateway, tmp_path: Path) -> None:
    before = _requests_by_outcome(gateway)
    run = run_pi(gateway.base_url, "tiny", "Say hello in one short sentence.", tmp_path, timeout=180, max_tokens=256)
    seen = _new_requests(before, _requests_by_outcome(gateway))

    assert run.returncode == 0, run.describe()
    assert seen[("true", "200")] >= 1, f"gateway saw {dict(seen)}\n{run.describe()}"
    assert set(seen) == {("true", "200")}, f"gateway saw {dict(seen)}\n{run.describe()}"
    kinds = [event.get("type") for event in run.parsed]
    assert kinds[0] == "session" and "agent_end" in kinds, run.describe()
    assistant = [
        e["message"] for e in run.parsed if e.get("type") == "message_end" and e["message"].get("role") == "assistant"
    ]
    assert assistant, run.describe()
    assert all(m.get("stopReason") in ("stop", "length", "toolUse") for m in assistant), run.describe()
    assert all(m.get("provider") == "gw" and m.get("model") == "tiny" for m in assistant)


def test_openclaw_completes_a_turn_through_the_gateway(agents: Path, gateway: RunningGateway, tmp_path: Path) -> None:
    before = _requests_by_outcome(gateway)
    run = run_openclaw(gateway.base_url, "tiny", "Say hello in one short sentence.", tmp_path, max_tokens=256)
    seen = _new_requests(before, _requests_by_outcome(gateway))

    assert run.returncode == 0, run.describe()
    assert seen[("true", "200")] >= 1, f"gateway saw {dict(seen)}\n{run.describe()}"
    assert set(seen) == {("true", "200")}, f"gateway saw {dict(seen)}\n{run.describe()}"
    assert isinstance(run.parsed, dict), run.describe()
    meta = run.parsed["meta"]
    assert meta["aborted"] is False, run.describe()
    assert meta["agentMeta"]["provider"] == "gw" and meta["agentMeta"]["model"] == "tiny"
    assert meta["completion"]["finishReason"] in ("stop", "length", "tool_calls"), run.describe()
    assert openclaw_texts(run), run.describe()
