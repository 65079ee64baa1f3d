"""Settings and their flags: one flag per setting, made from its field; the docs name real flags.

The flags are generated (``stream_gateway.cli.add_gateway_flags``), so these tests check the
outcome a person sees: ``stream-gateway serve --help``, what parsing gives, and the commands the
docs tell people to run.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from pipeline.connection import add_nats_arguments
from stream_gateway import Settings
from stream_gateway._settings import WITHOUT_FLAG
from stream_gateway.cli import settings_from_args
from stream_stack.cli import parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

OTHER_PROGRAMS_FLAGS = {
    "--enable-prompt-tokens-details": "vllm serve (cached_tokens in its usage)",
    "--enable-return-routed-experts": "vllm serve, sglang.launch_server",
    "--enable-scale-out": "vllm serve (its token-in generate API)",
    "--allowedTools": "claude",
    "--gil": "py-spy",
    "--incremental-streaming-output": "sglang",
    "--json": "codex exec",
    "--logprobs-mode": "vllm serve",
    "--mode": "pi-coding-agent",
    "--no-deps": "pip",
    "--no-session": "pi-coding-agent",
    "--resume": "claude",
    "--return-logprob": "sglang",
    "--session-dir": "pi-coding-agent",
    "--stream-interval": "vllm serve",
    "--structured-outputs-config": "vllm serve (its structured outputs backend)",
}
"""Flags of other programs that the docs name on their own in backticks (not ours: nothing to check)."""

_FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")
_OUR_COMMAND = re.compile(r"(?:^|[\s/])stream-gateway\s+([a-z-]+)(.*)")
_NEXT_COMMAND = re.compile(r"\s(?:\|\|?|&&?|;)\s|\s#")
_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    [subparsers] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def _flags(command: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag of ``command`` and the setting (argparse dest) it sets."""
    return {flag: action.dest for action in command._actions if action.dest != "help" for flag in action.option_strings}


def _listed(command: argparse.ArgumentParser) -> list[str]:
    """The flags ``--help`` lists, one per line of its options."""
    return re.findall(r"^  (?:-\w, )?(--[a-z0-9-]+)", command.format_help(), re.MULTILINE)


def test_every_setting_has_exactly_one_serve_flag_and_every_flag_is_a_setting() -> None:
    serve = _subcommands()["serve"]
    flags = _flags(serve)
    listed = [flag for flag in _listed(serve) if flag != "--help"]
    assert sorted(listed) == sorted(flags), "a flag that --help does not show, or shows twice"
    per_setting = Counter(flags[flag] for flag in listed)
    assert set(per_setting) - set(Settings.model_fields) == set(), "a serve flag that is no setting"
    assert set(Settings.model_fields) - set(per_setting) == set(WITHOUT_FLAG), "a setting without a flag"
    assert [name for name, count in per_setting.items() if count > 1] == [], "a setting with two flags"
    assert all(action.help for action in serve._actions), "a flag without help"


def test_settings_without_a_flag_say_why() -> None:
    assert set(WITHOUT_FLAG) <= set(Settings.model_fields)
    assert all(len(reason) > 20 for reason in WITHOUT_FLAG.values())


def test_up_has_the_serve_flags_but_the_ones_it_decides_itself() -> None:
    """``up`` runs its own NATS, one server (no NATS options, one replica), and keeps the outbox in its data dir."""
    nats = argparse.ArgumentParser()
    add_nats_arguments(nats)
    nats_settings = set(_flags(nats).values())
    commands = _subcommands()
    serve = set(_flags(commands["serve"]).values())
    up = set(_flags(commands["up"]).values()) & set(Settings.model_fields)
    assert up == serve - nats_settings - {"outbox_dir", "stream_replicas"}


def test_prepare_model_takes_the_model_settings() -> None:
    assert _flags(_subcommands()["prepare-model"]) == {"--model": "model", "--model-cache-dir": "model_cache_dir"}


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in os.environ:
        if name.startswith("STREAM_GATEWAY_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_flags_round_trip_to_settings(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("STREAM_GATEWAY_MAX_N", "3")  # a flag not given: the environment's value
    clean_environment.setenv("STREAM_GATEWAY_PORT", "1")  # a flag given wins over the environment
    argv = [
        "serve",
        "--port", "9001",
        "--engine", "synthetic",
        "--api-key", "k1", "--api-key", "k2",
        "--no-live-deltas",
        "--close-sessions-on-shutdown",
        "--max-sessions", "5",
        "--session-idle-seconds", "60",
        "--tool-parser", "qwen",
        "--kv-cache-on-update", "keep",
        "--nats-url", "nats://a:4222,nats://b:4222",
        "--model-cache-dir", "/tmp/models",
        "--upstream-max-connections", "7",
    ]  # fmt: skip
    settings = settings_from_args(parser().parse_args(argv))
    assert settings == Settings.model_validate(
        {
            "port": 9001,
            "engine": "synthetic",
            "api_keys": ("k1", "k2"),
            "live_deltas": False,
            "close_sessions_on_shutdown": True,
            "max_sessions": 5,
            "session_idle_seconds": 60.0,
            "tool_parser": "qwen",
            "kv_cache_on_update": "keep",
            "nats_url": "nats://a:4222,nats://b:4222",
            "model_cache_dir": Path("/tmp/models"),
            "upstream_max_connections": 7,
            "max_n": 3,
        }
    )
    assert settings.port == 9001
    assert settings.max_n == 3


def test_unset_flags_leave_the_defaults(clean_environment: pytest.MonkeyPatch) -> None:
    for command in ("serve", "up", "prepare-model"):
        assert settings_from_args(parser().parse_args([command])) == Settings.model_validate({})


def test_up_round_trip_ignores_its_own_flags(clean_environment: pytest.MonkeyPatch) -> None:
    argv = ["up", "--workers", "2", "--engine", "synthetic", "--batch-size", "4", "--nats-port", "0"]
    settings = settings_from_args(parser().parse_args(argv))
    assert settings == Settings.model_validate({"workers": 2, "engine": "synthetic"})


def test_a_value_the_setting_refuses_is_refused(clean_environment: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--tool-parser", "nope"])
    with pytest.raises(ValueError, match="max_sessions"):
        settings_from_args(parser().parse_args(["serve", "--max-sessions", "0"]))


def _doc_commands(text: str) -> list[tuple[int, str | None, str]]:
    """``(line, subcommand or None for a flag on its own, the text holding the flags)`` of ours in ``text``."""
    found: list[tuple[int, str | None, str]] = []
    subcommands = set(_subcommands())

    def command_at(line: int, code: str) -> None:
        if (match := _OUR_COMMAND.search(code)) and match.group(1) in subcommands:
            found.append((line, match.group(1), _NEXT_COMMAND.split(match.group(2))[0]))
        elif code.startswith("--"):
            found.append((line, None, code))
        elif (first := code.split(" ", 1)[0]) in subcommands and _FLAG.search(code):
            found.append((line, first, code))

    for block in _FENCED.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        held, start = "", 0
        for offset, code in enumerate(block.group(1).split("\n")):
            if not held:
                start = offset
            if code.endswith("\\"):  # the command goes on on the next line
                held += code.removesuffix("\\")
                continue
            command_at(first_line + start, (held + code).strip())
            held = ""
    prose = _FENCED.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    for span in _SPAN.finditer(prose):
        command_at(prose.count("\n", 0, span.start()) + 1, span.group(1).strip())
    return found


def test_docs_name_only_flags_that_exist_on_their_command() -> None:
    commands = {name: {"--help", *_flags(command)} for name, command in _subcommands().items()}
    ours = set().union(*commands.values())
    assert not ours & set(OTHER_PROGRAMS_FLAGS), "a flag of ours is exempted as another program's"
    wrong = []
    for path in DOCS:
        for line, command, code in _doc_commands(path.read_text()):
            known = commands[command] if command else ours | set(OTHER_PROGRAMS_FLAGS)
            for flag in _FLAG.findall(code):
                if flag not in known:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {flag} (on {command or 'any command'})")
    assert wrong == []


def test_the_doc_check_sees_commands_and_flags() -> None:
    """The doc check would catch a wrong flag in each place flags are written."""
    text = "\n".join(
        [
            "Use `--no-such-flag` or `serve --nats-url`.",
            "```bash",
            "STREAM_GATEWAY_X=1 .venv/bin/stream-gateway up --port 1 \\",
            "    --data-dir d | jq --raw",
            "```",
        ]
    )
    found = [(line, command, _FLAG.findall(code)) for line, command, code in _doc_commands(text)]
    assert found == [
        (3, "up", ["--port", "--data-dir"]),
        (1, None, ["--no-such-flag"]),
        (1, "serve", ["--nats-url"]),
    ]
