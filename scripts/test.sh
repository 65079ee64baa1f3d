#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The tool-loop and real-agent tests need tiny-agent, fine-tuned once per machine (~40 s, cached):
# build it here, with its own progress line, rather than inside one test's time limit.
echo "test set-up: tiny-agent model at $(.venv/bin/stream-gateway prepare-model --model tiny-agent)"
exec .venv/bin/python -m pytest "$@"
