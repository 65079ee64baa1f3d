"""Authenticated and encrypted NATS for every component, on real nats-servers.

The servers run with ``authorization`` (users with passwords, an NKey user, a token) and TLS
with client certificates (``verify: true``); certificates are issued per test session by a
throwaway CA (trustme). Right options connect; wrong ones fail at once, saying what was wrong,
for the library (:func:`pipeline.connection.connect`) and for every command.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import nkeys
import pytest
import trustme

from consumers.verl_adapter import StreamSettings
from pipeline.connection import NatsAuth, connect
from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig
from pipeline.errors import NatsRefused
from pipeline.kv import current_keys
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import of_session, read_stream
from ..support.servers import free_port, run_gateway, wait_healthy

PASSWORD = "correct horse battery staple"


@dataclass(frozen=True)
class Secured:
    """A TLS (client certificates required) + user/password + NKey server, and client files."""

    server: EmbeddedNatsServer
    ca: Path
    cert: Path
    key: Path
    nkey_seed: Path

    @property
    def url(self) -> str:
        return self.server.url

    def auth(self, **changes: object) -> NatsAuth:
        values: dict[str, object] = {
            "user": "gateway",
            "password": PASSWORD,
            "tls_ca": self.ca,
            "tls_cert": self.cert,
            "tls_key": self.key,
        }
        values.update(changes)
        return NatsAuth(**{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    directory = tmp_path_factory.mktemp("nats-tls")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("stream-gateway-client")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server_cert.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    server_cert.private_key_pem.write_to_path(str(directory / "server.key"))
    client_cert.cert_chain_pems[0].write_to_path(str(directory / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(directory / "client.key"))
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (directory / "user.nk").write_bytes(seed)
    config = NatsServerConfig(
        config_lines=(
            f'tls {{\n cert_file: "{directory / "server.pem"}"\n key_file: "{directory / "server.key"}"\n'
            f' ca_file: "{directory / "ca.pem"}"\n verify: true\n}}',
            f'authorization {{ users = [ {{user: "gateway", password: "{PASSWORD}"}}, {{nkey: "{public}"}} ] }}',
        )
    )
    with EmbeddedNatsServer(config) as server:
        yield Secured(server, directory / "ca.pem", directory / "client.pem", directory / "client.key",
                      directory / "user.nk")  # fmt: skip


def _try(url: str, auth: NatsAuth) -> str:
    """Connect as the long-running components do (reconnect forever): 'ok' or the refusal."""

    async def attempt() -> str:
        with anyio.fail_after(20):  # a refusal must end the attempt, not hang in retries
            try:
                nc = await connect(url, auth, max_reconnect_attempts=-1, connect_timeout=2)
            except NatsRefused as exc:
                return str(exc)
        try:
            await nc.jetstream().account_info()  # JetStream answers through the secured connection
        finally:
            await nc.close()
        return "ok"

    return anyio.run(attempt)


def test_tls_with_a_client_certificate_and_a_password_connects(secured: Secured) -> None:
    assert _try(secured.url, secured.auth()) == "ok"
    assert _try(secured.url, secured.auth(user=None, password=None, nkey=secured.nkey_seed)) == "ok"


def _connections(server: EmbeddedNatsServer) -> int:
    """How many client connections the server has accepted since it started, refused ones included."""
    return int(server.monitor("varz")["total_connections"])


def test_wrong_credentials_fail_at_once_saying_so(secured: Secured) -> None:
    before = _connections(secured.server)
    wrong = _try(secured.url, secured.auth(password="wrong"))
    assert "refused this client's credentials" in wrong and "user 'gateway'" in wrong, wrong
    nobody = _try(secured.url, secured.auth(user=None, password=None))
    assert "no credentials were given" in nobody and "--nats-user" in nobody, nobody
    other_seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    stranger = secured.nkey_seed.with_name("stranger.nk")
    stranger.write_bytes(other_seed)
    unknown_key = _try(secured.url, secured.auth(user=None, password=None, nkey=stranger))
    assert "refused this client's credentials" in unknown_key and "NKey seed file" in unknown_key, unknown_key
    # Each client tried once (``_try`` reconnects forever): a refusal ended the attempt, nothing retried.
    assert _connections(secured.server) - before == 3


def test_tls_problems_fail_at_once_saying_what_is_missing(secured: Secured) -> None:
    no_ca = _try(secured.url, secured.auth(tls_ca=None, tls_cert=None, tls_key=None))
    assert "TLS certificate was not accepted" in no_ca and "--nats-tls-ca" in no_ca, no_ca
    no_client_cert = _try(secured.url, secured.auth(tls_cert=None, tls_key=None))
    assert "TLS handshake failed" in no_client_cert and "--nats-tls-cert" in no_client_cert, no_client_cert


def test_token_authorization(tmp_path: Path) -> None:
    config = NatsServerConfig(config_lines=('authorization { token: "s3cr3t-token" }',))
    with EmbeddedNatsServer(config) as server:
        assert _try(server.url, NatsAuth(token="s3cr3t-token")) == "ok"
        refused = _try(server.url, NatsAuth(token="guess"))
        assert "refused this client's credentials" in refused and "a token" in refused, refused


def test_bad_option_combinations_are_refused_before_connecting(secured: Secured, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a user"):
        NatsAuth(password="x")
    with pytest.raises(ValueError, match="both --nats-tls-cert and --nats-tls-key"):
        NatsAuth(tls_cert=secured.cert)
    with pytest.raises(ValueError, match="does not exist"):
        NatsAuth(tls_ca=tmp_path / "missing.pem")
    assert "correct horse" not in repr(secured.auth())  # secrets never printed


def _command(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    return subprocess.run([sys.executable, "-m", "stream_stack", *args], capture_output=True, text=True,
                          env=base | (env or {}), timeout=timeout)  # fmt: skip


def _tls_flags(secured: Secured) -> list[str]:
    return ["--nats-tls-ca", str(secured.ca), "--nats-tls-cert", str(secured.cert), "--nats-tls-key", str(secured.key)]


@pytest.mark.parametrize("command", ["tail", "assemble", "batch", "publish-weights"])
def test_every_command_with_a_wrong_password_exits_with_the_reason(
    secured: Secured, command: str, tmp_path: Path
) -> None:
    extra = {"publish-weights": [str(tmp_path), "--policy-version", "1"], "tail": ["--limit", "1"]}.get(command, [])
    result = _command(command, *extra, "--nats-url", secured.url, "--nats-user", "gateway", *_tls_flags(secured),
                      env={"STREAM_GATEWAY_NATS_PASSWORD": "not the password"})  # fmt: skip
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "refused this client's credentials" in result.stderr, result.stderr
    assert "not the password" not in result.stderr


def test_the_gateway_captures_through_tls_and_credentials(
    secured: Secured, tiny_model_path: Path, tmp_path: Path
) -> None:
    """``serve`` with the NATS options: a streamed turn's events and its shared session state
    land on the secured server (the password from the environment), and ``tail`` reads them."""
    port = free_port()
    log = tmp_path / "gateway.log"
    command = [sys.executable, "-m", "stream_stack", "serve", "--engine", "synthetic", "--model", str(tiny_model_path),
               "--served-model-name", "m", "--port", str(port), "--nats-url", secured.url, "--nats-user", "gateway",
               *_tls_flags(secured), "--outbox-dir", str(tmp_path / "outbox")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    env["STREAM_GATEWAY_NATS_PASSWORD"] = PASSWORD
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port, log=log)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/sessions/tls-s1/v1/chat/completions", json=body,
                          timeout=30) as response:  # fmt: skip
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        deadline = time.monotonic() + 30
        kinds: list[str] = []
        while time.monotonic() < deadline and "turn.completed" not in kinds:
            events = [event for _, event in read_stream(secured.url, auth=secured.auth())]
            kinds = [event.kind for event in of_session(events, "tls-s1")]
            time.sleep(0.2)
        assert "turn.completed" in kinds, kinds

        async def sessions_bucket_keys() -> list[str]:
            nc = await connect(secured.url, secured.auth())
            try:
                kv = await nc.jetstream().key_value("sg_sessions")
                return await current_keys(kv)
            finally:
                await nc.close()

        assert anyio.run(sessions_bucket_keys)  # the shared session state was written
        # tail reads it too, the password again from the environment, never the command line
        tail = _command("tail", "--from-start", "--session", "tls-s1", "--kind", "turn.completed", "--limit", "1",
                        "--no-color", "--nats-url", secured.url, "--nats-user", "gateway", *_tls_flags(secured),
                        env={"STREAM_GATEWAY_NATS_PASSWORD": PASSWORD})  # fmt: skip
        assert tail.returncode == 0, tail.stderr
        assert "tls-s1" in tail.stdout and "turn.completed" in tail.stdout, tail.stdout
    finally:
        process.terminate()
        process.wait(30)
    assert "refused" not in log.read_text()


def test_a_gateway_refused_by_nats_says_so_and_keeps_serving(
    secured: Secured, tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Wrong credentials on a running gateway: an error in its log naming the cause, answers
    still served, and the events kept (in its outbox) for when the credentials are fixed."""
    settings = Settings(
        engine="synthetic",
        model=str(tiny_model_path),
        served_model_name="m",
        nats_url=secured.url,
        nats_user="gateway",
        nats_password="wrong",
        nats_tls_ca=secured.ca,
        nats_tls_cert=secured.cert,
        nats_tls_key=secured.key,
        outbox_dir=tmp_path / "outbox",
        durable_wait_seconds=0.5,
        policy_sync_timeout_seconds=1,
    )
    caplog.set_level(logging.ERROR)
    with run_gateway(build_engine(settings), settings) as gateway:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "refused this client's credentials" not in caplog.text:
            time.sleep(0.1)
    assert "refused this client's credentials" in caplog.text, caplog.text
    assert "wrong" not in caplog.text
    saved = list((tmp_path / "outbox").rglob("*"))
    assert any(path.is_file() and path.stat().st_size for path in saved), saved


def test_the_verl_adapter_takes_nats_auth_from_its_config(secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"actor_rollout_ref": {"rollout": {"custom": {"stream_gateway": {
        "nats_url": secured.url, "pad_token_id": 0,
        "nats_auth": {"user": "gateway", "tls_ca": str(secured.ca), "tls_cert": str(secured.cert),
                      "tls_key": str(secured.key)}}}}}}  # fmt: skip
    monkeypatch.setenv("STREAM_GATEWAY_NATS_PASSWORD", PASSWORD)  # config files need not hold it
    settings = StreamSettings.from_verl_config(config)
    assert settings.nats_auth == secured.auth()
    assert _try(secured.url, settings.nats_auth) == "ok"


def _imports(package: str) -> set[str]:
    found: set[str] = set()
    for path in (Path(__file__).resolve().parents[2] / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_the_packages_depend_in_one_direction() -> None:
    """stream_gateway → pipeline ← consumers; only stream_stack composes them all."""
    assert not _imports("stream_gateway") & {"consumers", "stream_stack"}
    assert not _imports("consumers") & {"stream_gateway", "stream_stack"}
    assert not _imports("pipeline") & {"stream_gateway", "consumers", "stream_stack"}
    assert {"stream_gateway", "pipeline", "consumers"} <= _imports("stream_stack")
