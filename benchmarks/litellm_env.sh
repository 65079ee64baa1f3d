#!/usr/bin/env bash
# Create (idempotently) the separate virtual environment that runs LiteLLM's proxy for the
# gateway-vs-LiteLLM benchmark.
#
# LiteLLM is NEVER a dependency of this project: it lives only in benchmarks/.venv-litellm
# (git-ignored), and benchmarks/litellm_proxy.py runs it from there as a subprocess.
#
# Pin: litellm[proxy]==1.106.* -- strictly below 1.107, because the 1.107.0 release was compromised.
# The [proxy] extra installs as is (uvicorn, uvloop, fastapi, gunicorn, ... ; no Prisma): nothing to trim.
# What it resolves to here: 1.106.2. LiteLLM 1.106.3 to 1.106.10 require certifi>=2026.10.19, which the package
# index does not serve (its newest is 2026.10.18), so pip backtracks to 1.106.2. Once that certifi is out, the
# same spec may pick a newer 1.106.x: the benchmark reports the version it ran (printed below).
#
# Usage: bash benchmarks/litellm_env.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${here}/.venv-litellm"
spec='litellm[proxy]==1.106.*'

if [[ ! -x "${venv}/bin/python" ]]; then
    python3 -m venv "${venv}"
    "${venv}/bin/python" -m pip install --quiet --upgrade pip
fi

# pip is a no-op when an installed version already satisfies the spec.
"${venv}/bin/python" -m pip install --quiet "${spec}"

# Refuse anything at or above 1.107 even if the spec were edited by mistake.
"${venv}/bin/python" - <<'PY'
from importlib.metadata import version

v = version("litellm")
major, minor = (int(p) for p in v.split(".")[:2])
if (major, minor) >= (1, 107):
    raise SystemExit(f"litellm {v} is installed; only versions below 1.107 are allowed")
print(f"litellm {v}")
PY
