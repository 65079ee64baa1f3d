"""The deployment artefacts under deploy/: the image, the Kubernetes manifests, the NATS chart's
values and the Grafana dashboard (docs/deploy.md).

No cluster and no image build here. The kustomizations are rendered by :func:`render`, which
knows the features deploy/ uses (resources, namespace, images, strategic merge patches) and fails
on any other key; where ``kubectl`` is installed, its ``kubectl kustomize`` must print the same
objects. Every object is validated against the Kubernetes 1.37 schema by kubernetes-validate,
strictly (an unknown field is an error). Then the facts that tie the files together: probes on
/health at the container port, container arguments that ``stream-gateway`` parses, a ConfigMap of
real settings, the Secrets the manifests read, the Dockerfile's user, volumes and health check,
and dashboard queries on metrics the gateway exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pipeline import PublisherStatistics
from stream_gateway import Settings
from stream_gateway._metrics import GatewayMetrics
from stream_gateway.completion import Histories
from stream_gateway.http import decode_body
from stream_stack.cli import parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
PRODUCTION = DEPLOY / "kubernetes" / "overlays" / "production"
KUBERNETES_VERSION = "1.37"

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints, for the kustomization features deploy/ uses."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: the test's render() does not know {sorted(unknown)}"
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, "only strategic merge patches named by path"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        [target] = [o for o in objects if _identity(o) == _identity(body)]
        _merge(target, body)
    for image in kustomization.get("images", []):
        for container in _containers(objects):
            name, tag = _split_image(container["image"])
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in kustomization:
        for o in objects:
            o["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _identity(o: dict[str, Any]) -> tuple[str, str]:
    return o["kind"], o["metadata"]["name"]


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    """Strategic merge as kustomize does it for what deploy/ patches: maps recursively, lists of named items by name."""
    for key, value in patch.items():
        have = base.get(key)
        if isinstance(value, dict) and isinstance(have, dict):
            _merge(have, value)
        elif isinstance(value, list) and isinstance(have, list) and all("name" in i for i in value + have):
            named = {item["name"]: item for item in have}
            for item in value:
                if item["name"] in named:
                    _merge(named[item["name"]], item)
                else:
                    have.append(item)
        else:
            base[key] = value


def _split_image(image: str) -> tuple[str, str]:
    """``name``, ``tag`` of an image reference (a registry's port is no tag)."""
    if ":" in image.rsplit("/", 1)[-1]:
        name, _, tag = image.rpartition(":")
        return name, tag
    return image, ""


def _pod_specs(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for o in objects:
        if o["kind"] == "Deployment":
            yield o["spec"]["template"]["spec"]


def _containers(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for spec in _pod_specs(objects):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if _identity(o) == (kind, name)]
    return found


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(BASE)


@pytest.fixture(scope="module")
def production() -> list[dict[str, Any]]:
    return render(PRODUCTION)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all(path.read_text()) if o]


@pytest.mark.parametrize("overlay", [BASE, PRODUCTION], ids=["base", "production"])
def test_every_object_is_valid_kubernetes(overlay: Path) -> None:
    objects = render(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
    ]
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here (its kustomize is the reference)")
@pytest.mark.parametrize("overlay", [BASE, PRODUCTION], ids=["base", "production"])
def test_render_gives_what_kubectl_kustomize_gives(overlay: Path) -> None:
    done = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    real = [o for o in yaml.safe_load_all(done.stdout) if o]
    assert sorted(real, key=_identity) == sorted(render(overlay), key=_identity)


def test_the_secrets_template_is_valid_and_never_applied(base: list[dict[str, Any]]) -> None:
    secrets = _documents(DEPLOY / "kubernetes" / "secrets.example.yaml")
    for o in secrets:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    assert {o["kind"] for o in secrets} == {"Secret"}
    assert not [o for o in base if o["kind"] == "Secret"], "placeholders would be applied"


def test_the_validator_refuses_a_wrong_field(base: list[dict[str, Any]]) -> None:
    """The schema check can fail: a misspelt probe field is refused."""
    deployment = json.loads(json.dumps(_one(base, "Deployment", "stream-gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_overlay_sets_image_namespace_and_resources_and_keeps_the_rest(
    base: list[dict[str, Any]], production: list[dict[str, Any]]
) -> None:
    assert {c["image"] for c in _containers(base)} == {"stream-gateway:0.1.0"}
    assert {c["image"] for c in _containers(production)} == {"registry.example.com/ml-platform/stream-gateway:0.1.0"}
    assert {o["metadata"].get("namespace") for o in base} == {None}
    assert {o["metadata"]["namespace"] for o in production} == {"stream-gateway"}
    gateway = _one(production, "Deployment", "stream-gateway")["spec"]["template"]["spec"]
    [container] = gateway["containers"]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "12Gi"}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health", "the patch dropped the probes"
    volumes = {v["name"]: v for v in gateway["volumes"]}
    assert volumes["outbox"]["emptyDir"]["sizeLimit"] == "20Gi"
    assert set(volumes) == {"models", "outbox", "tmp", "keys"}
    assert _one(production, "HorizontalPodAutoscaler", "stream-gateway")["spec"]["maxReplicas"] == 20


def _gateway(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway's pod template and its one container."""
    template = _one(objects, "Deployment", "stream-gateway")["spec"]["template"]
    [container] = template["spec"]["containers"]
    return template, container


def _dockerfile() -> list[tuple[str, str]]:
    """``(INSTRUCTION, rest)`` of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _runtime_stage() -> list[tuple[str, str]]:
    """The instructions of the Dockerfile's last stage, the image that runs."""
    instructions = _dockerfile()
    last = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    return instructions[last:]


def _image_environment() -> dict[str, str]:
    """The runtime image's environment (its one ENV)."""
    [env] = [rest for instruction, rest in _runtime_stage() if instruction == "ENV"]
    return dict(item.split("=", 1) for item in env.split())


@pytest.mark.parametrize("overlay", [BASE, PRODUCTION], ids=["base", "production"])
def test_probes_and_scraping_point_at_the_gateway_port(overlay: Path) -> None:
    objects = render(overlay)
    template, container = _gateway(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    image_port = int(_image_environment()["STREAM_GATEWAY_PORT"])
    assert ("EXPOSE", str(image_port)) in _dockerfile()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health"
        assert ports[get["port"]] == image_port
    [service_port] = _one(objects, "Service", "stream-gateway")["spec"]["ports"]
    assert ports[service_port["targetPort"]] == image_port
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == image_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_three_gateways_at_least_scaled_on_cpu_one_disrupted_at_a_time(base: list[dict[str, Any]]) -> None:
    deployment = _one(base, "Deployment", "stream-gateway")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the count; apply would fight it"
    hpa = _one(base, "HorizontalPodAutoscaler", "stream-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "stream-gateway"}
    assert hpa["minReplicas"] == 3
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert "cpu" in _gateway(base)[1]["resources"]["requests"], "CPU utilisation needs a CPU request"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = _one(base, "PodDisruptionBudget", "stream-gateway")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == labels == deployment["spec"]["selector"]["matchLabels"]
    service = _one(base, "Service", "stream-gateway")["spec"]
    assert service["selector"] == labels
    for name in ("stream-gateway-assembler", "stream-gateway-batcher"):
        consumer = _one(base, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert not set(service["selector"].items()) <= set(consumer.items()), f"the Service would reach {name}"
    batcher = _one(base, "Deployment", "stream-gateway-batcher")["spec"]
    assert batcher["replicas"] == 1
    assert batcher["strategy"]["type"] == "Recreate", "one batcher per consumer, even during a rollout"


def _configmap(objects: list[dict[str, Any]]) -> dict[str, str]:
    data: dict[str, str] = _one(objects, "ConfigMap", "stream-gateway")["data"]
    return data


def test_the_configmap_holds_settings_the_gateway_accepts(
    base: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _configmap(base)
    for name in list(os.environ):
        if name.startswith("STREAM_GATEWAY_"):
            monkeypatch.delenv(name)
    unknown = [k for k in data if k.removeprefix("STREAM_GATEWAY_").lower() not in Settings.model_fields]
    assert unknown == []
    for key, value in {**_image_environment(), **data}.items():
        if key.startswith("STREAM_GATEWAY_"):
            monkeypatch.setenv(key, value)
    settings = Settings()
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    cluster = values["config"]["cluster"]["replicas"]
    assert settings.stream_replicas == cluster == 3
    assert settings.nats_servers() == tuple(f"nats://nats-{i}.nats-headless:4222" for i in range(cluster))
    assert settings.host == "0.0.0.0" and settings.api_key_file is not None, "a public address needs keys"


def _substitute(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in container arguments."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def _environment(container: dict[str, Any], configmap: dict[str, str]) -> dict[str, str]:
    env = dict(configmap) if container.get("envFrom") else {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif ref := item["valueFrom"].get("configMapKeyRef"):
            env[item["name"]] = configmap[ref["key"]]
    return env


def test_every_container_runs_a_stream_gateway_command(base: list[dict[str, Any]]) -> None:
    commands = []
    for container in _containers(base):
        args = _substitute(container["args"], _environment(container, _configmap(base)))
        parsed = parser().parse_args(args)  # an unknown flag or command exits
        commands.append(args[0])
        if getattr(parsed, "nats_url", None):
            assert len(parsed.nats_url.split(",")) == 3
        if args[0] in ("assemble", "batch"):
            assert parsed.stream_replicas == 3, "the consumers' streams need the copies the gateways' have"
    assert sorted(commands) == ["assemble", "batch", "prepare-model", "serve"]


def test_a_wrong_flag_in_a_container_would_be_caught() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["assemble", "--stream-replicaz", "3"])


def _secret_references(objects: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    """``(secret, key)`` every manifest reads; ``key`` None for a whole Secret mounted as a volume."""
    found: set[tuple[str, str | None]] = set()
    for container in _containers(objects):
        for item in container.get("env", []):
            if ref := item.get("valueFrom", {}).get("secretKeyRef"):
                found.add((ref["name"], ref["key"]))
    for spec in _pod_specs(objects):
        found |= {(v["secret"]["secretName"], None) for v in spec["volumes"] if "secret" in v}
    return found


def test_the_secrets_read_are_the_ones_the_template_defines(base: list[dict[str, Any]]) -> None:
    secrets = _documents(DEPLOY / "kubernetes" / "secrets.example.yaml")
    defined = {o["metadata"]["name"]: set(o["stringData"]) for o in secrets}
    nats = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    env = {**nats["container"]["env"], **nats["natsBox"]["container"]["env"]}
    read = _secret_references(base) | {
        (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
        for v in env.values()
        if isinstance(v, dict)
    }
    assert {(name, key) for name, key in read if name not in defined or (key and key not in defined[name])} == set()
    # The key files the ConfigMap names are in the Secret mounted where the ConfigMap says.
    _, container = _gateway(base)
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "keys"]
    data = _configmap(base)
    for setting in ("STREAM_GATEWAY_API_KEY_FILE", "STREAM_GATEWAY_REASONING_KEY_FILE"):
        path = Path(data[setting])
        assert str(path.parent) == mount["mountPath"]
        assert path.name in defined["stream-gateway-keys"]


def test_every_container_is_unprivileged_with_a_read_only_root(base: list[dict[str, Any]]) -> None:
    [volumes] = [rest for instruction, rest in _runtime_stage() if instruction == "VOLUME"]
    image_volumes = json.loads(volumes)
    for spec in _pod_specs(base):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
    _, gateway = _gateway(base)
    mounted = {m["mountPath"] for m in gateway["volumeMounts"]}
    assert set(image_volumes) <= mounted, "the image's volumes are the gateway's writable places"
    environment = _image_environment()
    for setting in ("STREAM_GATEWAY_MODEL_CACHE_DIR", "STREAM_GATEWAY_OUTBOX_DIR", "HF_HOME"):
        assert any(Path(environment[setting]).is_relative_to(volume) for volume in image_volumes), setting


def test_the_dockerfile_builds_in_two_stages_and_runs_unprivileged() -> None:
    instructions = _dockerfile()
    stages = [i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM"]
    assert len(stages) == 2
    assert instructions[stages[0]][1] == "${BASE_IMAGE} AS builder"
    runtime = _runtime_stage()
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    [user] = [rest for instruction, rest in runtime if instruction == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    [entrypoint] = [json.loads(rest) for instruction, rest in runtime if instruction == "ENTRYPOINT"]
    assert entrypoint == ["tini", "--", "stream-gateway"]
    args = dict(rest.split("=", 1) for instruction, rest in instructions if instruction == "ARG" and "=" in rest)
    assert args["BASE_IMAGE"] == "python:3.12-slim-bookworm"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    settings = [key for key in _image_environment() if key.startswith("STREAM_GATEWAY_")]
    assert [key for key in settings if key.removeprefix("STREAM_GATEWAY_").lower() not in Settings.model_fields] == []


def test_the_image_holds_every_package_of_the_project() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {
        source
        for instruction, rest in _dockerfile()
        if instruction == "COPY" and "--from" not in rest
        for source in rest.split()[:-1]
    }
    assert packages <= copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert copied <= {line[1:] for line in ignore if line.startswith("!")}, "the build context leaves it out"


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_health_check_passes_on_200_and_fails_on_503() -> None:
    [check] = [rest for instruction, rest in _dockerfile() if instruction == "HEALTHCHECK"]
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command[:2] == ["python3", "-c"]
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {"STREAM_GATEWAY_PORT": str(server.server_address[1])}
        for status, healthy in ((200, True), (503, False)):
            _Health.status = status
            done = subprocess.run([sys.executable, "-c", command[2]], env=env, capture_output=True, timeout=30)
            assert (done.returncode == 0) is healthy, done.stderr
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_nats_runs_three_jetstream_servers_on_persistent_volumes() -> None:
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    config = values["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["memoryStore"]["enabled"] is False
    store = jetstream["fileStore"]
    assert store["enabled"] is True and store["pvc"]["enabled"] is True
    assert re.fullmatch(r"\d+Gi", store["pvc"]["size"])
    users = {u["user"]: u["password"] for u in config["merge"]["authorization"]["users"]}
    for password in users.values():
        match = re.fullmatch(r"<< \$(\w+) >>", password)
        assert match, f"a password written into the values: {password!r}"
        assert "secretKeyRef" in values["container"]["env"][match.group(1)]["valueFrom"]
    consumers = [c for c in _containers(render(BASE)) if c["args"][0] in ("assemble", "batch")]
    named = {_configmap(render(BASE))["STREAM_GATEWAY_NATS_USER"]}
    named |= {c["args"][c["args"].index("--nats-user") + 1] for c in consumers}
    assert named <= set(users)


def _exported_names() -> set[str]:
    """Every sample name the gateway's /metrics can show, from its real registry (capture on)."""
    metrics = GatewayMetrics()
    zeros = {f.name: 0 for f in fields(PublisherStatistics)}
    metrics.watch_publisher(lambda: PublisherStatistics(**{**zeros, "connected": False}))
    metrics.watch_sessions([])
    metrics.watch_histories(Histories(0, decode_body))
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    return {f"{family.name}{suffix}" for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "stream-gateway.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    exported = _exported_names()
    used = {name for expr in _dashboard_queries() for name in re.findall(r"\bgateway_\w+", expr)}
    assert used - exported == set()
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in exported}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert families - shown == set(), "a metric without a panel: add one to deploy/grafana/stream-gateway.json"


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "stream-gateway.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
