"""New weights for a running gateway: applied one at a time, from NATS or a local directory.

:class:`PolicyApplier` is the one way weights change: versions only go up, a checkpoint the
engine refuses leaves the old weights serving, and every outcome is a ``policy.applied`` or
``policy.rejected`` event, a metric and a log line. ``POST /policy/weights`` and
:class:`PolicyFollower` both go through it.

:class:`PolicyFollower` (gateways started with ``--nats-url``) follows ``policy.updated`` on the
events stream. On start it replays the stream's history as a replica that saw it live would have
(:func:`replay_plan`) and applies the newest full version and the partial ones after it; a version
refused on the way (here, or marked refused in the policy store by the replica that refused it
first) is left out and the history replayed again, so a replica started late comes up on the
version its peers serve, never on the base because the newest upload was bad (the app
waits for this, up to ``policy_sync_timeout_seconds``, before taking requests); then it applies
each new one as it arrives. Downloading, checking digests, reading the safetensors and checking
names and shapes all happen while decoding goes on; decoding stops only for the copy into the
model and the KV recompute (:meth:`Engine.update_weights`).

LoRA adapters published over NATS (``policy.updated`` with ``adapter``, on their own subject) take
the same road with their own versions: downloaded, then :meth:`PolicyApplier.apply_adapter` on the
directory (the engine loads it between two decode steps; a new name adds an adapter). At start the
follower brings every adapter in the history to its newest version that applies (a refused one is
reported, and the version before it tried). Engines without LoRA report each adapter version as
``policy.rejected`` ``unsupported`` and go on serving.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from pipeline.connection import NatsAuth, connect
from pipeline.errors import NatsRefused, PolicyDownloadError
from pipeline.events import PolicyUpdated, decode_event
from pipeline.policies import download_policy, mark_refused, policy_history, policy_subjects, refusal_mark
from pipeline.streams import StreamSpec

from stream_gateway._errors import PolicyNotNewer, WeightsRejected
from stream_gateway._metrics import GatewayMetrics
from stream_gateway.capture import EventRecorder
from stream_gateway.engines import Engine, WeightUpdateReport

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = ["PolicyApplier", "PolicyFollower", "PolicyNotNewer", "replay_plan"]

log = logging.getLogger(__name__)

# Refusals that no retry can change: the version is marked refused for every later replica. (A
# failed download may be a network's fault; ``not_newer`` depends on the replica.)
_REFUSED_FOR_GOOD = frozenset({"digest_mismatch", "unreadable", "unknown_tensors", "shape_mismatch"})


def replay_plan(history: list[PolicyUpdated], start: int, refused: set[str]) -> list[PolicyUpdated]:
    """What a replica serving ``start`` that saw ``history`` (oldest first) live would have applied
    last, taking every version not refused: the newest full version it took and the partial ones
    after it (all it took, when it took no full one)."""
    taken: list[PolicyUpdated] = []
    current = start
    for event in history:
        if event.event_id in refused or event.policy_version <= current:
            continue
        taken.append(event)
        current = event.policy_version
    fulls = [i for i, e in enumerate(taken) if e.full]
    return taken[fulls[-1] :] if fulls else taken


async def _marked_refused(js: JetStreamContext, event: PolicyUpdated) -> tuple[str, str, str] | None:
    try:
        return await refusal_mark(js, event)
    except Exception as exc:  # an unreadable mark is no mark: the version is tried
        log.debug("policy follower: cannot read the refusal mark of version %d: %s", event.policy_version, exc)
        return None


class PolicyApplier:
    """Applies weights to ``engine`` one update at a time and reports each outcome."""

    def __init__(self, engine: Engine, recorder: EventRecorder, metrics: GatewayMetrics, replica: str) -> None:
        self._engine = engine
        self._recorder = recorder
        self._metrics = metrics
        self.replica = replica
        self._lock = anyio.Lock()
        metrics.policy_version.set(engine.policy_version)

    @property
    def policy_version(self) -> int:
        """The version the engine samples from now."""
        return self._engine.policy_version

    @property
    def remote(self) -> bool:
        """The engine's weights live on remote servers (a new version is only recorded)."""
        return self._engine.remote

    @property
    def reloads_servers(self) -> bool:
        """The engine loads each version into remote servers itself (``--upstream-weights reload``),
        from a directory they can read, which stays until the next version replaces it."""
        return bool(getattr(self._engine, "reloads_weights", False))

    @property
    def engine_name(self) -> str:
        """The engine's name (``transformers``, ``vllm-http``...)."""
        return self._engine.name

    @property
    def serves_adapters(self) -> bool:
        """The engine can load LoRA adapters from a path: the transformers engine (which still
        refuses them ``unsupported`` when started without ``--lora``), and the remote engines
        (on their servers, from storage they share with the gateway)."""
        return callable(getattr(self._engine, "load_adapter", None))

    @property
    def takes_downloaded_adapters(self) -> bool:
        """The engine can load an adapter the NATS follower downloaded to a temporary directory of
        this machine: not a remote engine, whose servers cannot read it."""
        return self.serves_adapters and not self._engine.remote

    def adapter_version(self, name: str) -> int | None:
        """The version of adapter ``name`` in service; ``None``: not loaded."""
        return self._engine.adapters.get(name)

    async def apply_directory(
        self, path: str | Path, policy_version: int, *, source: str, download_s: float = 0.0
    ) -> WeightUpdateReport:
        """Load the safetensors files of ``path`` as ``policy_version``.

        Raises :class:`PolicyNotNewer` or :class:`WeightsRejected` (after reporting them);
        the weights in service are then unchanged.
        """
        async with self._lock:
            current = self._engine.policy_version
            if policy_version <= current:
                detail = f"version {policy_version} is not above the current {current}"
                self.reject(policy_version, "not_newer", detail)
                raise PolicyNotNewer(detail)
            started = time.perf_counter()
            try:
                report = await self._engine.load_weights(str(path), policy_version)
            except WeightsRejected as exc:
                self.reject(policy_version, exc.reason, str(exc))
                raise
        apply_s = time.perf_counter() - started
        self._recorder.policy_applied(
            report, replica=self.replica, source=source, download_s=download_s, apply_s=apply_s
        )
        metrics = self._metrics
        metrics.policy_version.set(report.policy_version)
        metrics.policy_updates.labels("applied").inc()
        metrics.policy_pause.observe(report.pause_s)
        if download_s:
            metrics.policy_download.observe(download_s)
        log.info(
            "policy %d -> %d applied from %s: download %.2f s, apply %.2f s, decoding paused %.1f ms "
            "(copy %.1f ms, %d requests in flight continued)",
            report.previous_version, report.policy_version, source, download_s, apply_s,
            report.pause_s * 1e3, report.copy_s * 1e3, report.in_flight,
        )  # fmt: skip
        return report

    async def apply_adapter(
        self, name: str, path: str | Path, policy_version: int, *, source: str | None = None, download_s: float = 0.0
    ) -> WeightUpdateReport:
        """Load the PEFT adapter directory ``path`` as version ``policy_version`` of adapter
        ``name`` (docs/adapters.md): versions only go up per adapter; a new name adds one.

        Raises :class:`PolicyNotNewer`, or :class:`~stream_gateway.lora.AdapterRefused` for an
        adapter the base cannot take or an engine without LoRA (after reporting them, as
        ``policy.rejected`` with ``adapter``); the adapters in service are then unchanged.
        """
        from stream_gateway._errors import AdapterRefused

        async with self._lock:
            current = self._engine.adapters.get(name)
            if current is not None and policy_version <= current:
                detail = f"adapter {name}: version {policy_version} is not above the current {current}"
                self.reject(policy_version, "not_newer", detail, adapter=name)
                raise PolicyNotNewer(detail)
            if not self.serves_adapters:
                refused = AdapterRefused("unsupported", f"the {self._engine.name} engine serves no LoRA adapters")
                self.reject(policy_version, refused.reason, str(refused), adapter=name)
                raise refused
            started = time.perf_counter()
            try:
                report: WeightUpdateReport = await self._engine.load_adapter(name, str(path), policy_version)  # type: ignore[attr-defined]
            except AdapterRefused as exc:
                self.reject(policy_version, exc.reason, str(exc), adapter=name)
                raise
        apply_s = time.perf_counter() - started
        self._recorder.policy_applied(
            report,
            replica=self.replica,
            source=source if source is not None else str(path),
            download_s=download_s,
            apply_s=apply_s,
            adapter=name,
        )
        self._metrics.policy_updates.labels("applied").inc()
        self._metrics.policy_pause.observe(report.pause_s)
        if download_s:
            self._metrics.policy_download.observe(download_s)
        log.info(
            "adapter %s %d -> %d applied from %s: download %.2f s, apply %.2f s, decoding paused %.1f ms",
            name, report.previous_version, policy_version, source or path, download_s, apply_s, report.pause_s * 1e3,
        )  # fmt: skip
        return report

    def reject(self, policy_version: int, reason: str, detail: str, *, adapter: str | None = None) -> None:
        """Report a refused version of the base or of LoRA ``adapter`` (the engine keeps what it serves)."""
        metrics = self._metrics
        if adapter is None:
            current = self._engine.policy_version
            log.warning(
                "policy %d rejected (%s): %s; still serving version %d", policy_version, reason, detail, current
            )
        else:
            current = self._engine.adapters.get(adapter, 0)
            log.warning(
                "adapter %s version %d rejected (%s): %s; still serving %s",
                adapter, policy_version, reason, detail,
                f"version {current}" if adapter in self._engine.adapters else "no such adapter",
            )  # fmt: skip
        metrics.policy_updates.labels(reason).inc()
        self._recorder.policy_rejected(current, policy_version, reason, detail, replica=self.replica, adapter=adapter)


class PolicyFollower:
    """Applies every policy published on NATS (``policy.updated``) through a :class:`PolicyApplier`."""

    def __init__(
        self,
        applier: PolicyApplier,
        servers: tuple[str, ...],
        spec: StreamSpec,
        download_dir: Path | None = None,
        auth: NatsAuth | None = None,
    ) -> None:
        self._applier = applier
        self._servers = servers
        self._auth = auth
        self._spec = spec
        self._download_dir = download_dir
        self._kept: Path | None = None  # the version the servers reload from (--upstream-weights reload)
        self.caught_up = anyio.Event()  # set once the history was replayed (or there was none)
        self._handled: set[str] = set()  # event ids applied or rejected: replays of them stay quiet

    def _seen(self, event: PolicyUpdated) -> bool:
        return event.event_id in self._handled

    async def run(self) -> None:
        """Connect, catch up with the history, then apply updates as they come; until cancelled.

        NATS unreachable or failing: the gateway goes on serving its current weights (start-up
        does not wait for a server that is down), and the follower retries, catching up again.
        """
        backoff = 0.5
        while True:
            try:
                await self._follow()
            except NatsRefused as exc:
                log.error("policy follower: %s; retrying", exc)
            except Exception as exc:  # nats-py raises several unrelated types for connection trouble
                log.warning("policy follower: NATS at %s failed (%s); retrying", ",".join(self._servers), exc)
            self.caught_up.set()  # never hold start-up for a server that is not there
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _follow(self) -> None:
        from nats.js.api import ConsumerConfig, DeliverPolicy
        from pipeline.streams import ensure_stream

        nc = await connect(
            self._servers,
            self._auth,
            name=f"stream-gateway-policy-{self._applier.replica}",
            connect_timeout=2,
            allow_reconnect=False,  # a lost connection restarts the follow loop, which catches up
        )
        try:
            js = nc.jetstream()
            await ensure_stream(js, self._spec)
            # Subscribe first, then read the history: an update published in between is seen twice
            # at worst, and the second time it is not newer (skipped quietly).
            subscription = await js.subscribe(
                policy_subjects(self._spec.prefix),  # the base's and the adapters'
                stream=self._spec.stream,
                ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
            )
            await self._catch_up(js)
            await self._catch_up_adapters(js)
            self.caught_up.set()
            async for msg in subscription.messages:
                try:
                    event = decode_event(msg.data)
                except ValueError as exc:
                    log.warning("policy follower: undecodable policy.updated message: %s", exc)
                    continue
                if isinstance(event, PolicyUpdated) and event.adapter is not None:
                    await self._apply_adapter(js, event, quiet_if_old=self._seen(event))
                elif isinstance(event, PolicyUpdated):
                    await self._apply(js, event, quiet_if_old=self._seen(event))
        finally:
            with anyio.CancelScope(shield=True):
                await nc.close()

    async def _catch_up(self, js: JetStreamContext) -> None:
        """Come up on what the replicas that saw every update serve: replay the history as they did
        (in publication order, skipping versions not above the current one and those refused), apply
        the newest full version of that replay and the partial ones after it, and when one of those
        is refused here (or marked refused by another replica), replay again without it."""
        try:
            history = await policy_history(js, self._spec)
        except Exception as exc:  # no stream yet, or NATS went away: follow live updates only
            log.warning("policy follower: could not read the policy history (%s); following new updates", exc)
            return
        history = [e for e in history if e.adapter is None]
        start = self._applier.policy_version
        refused: set[str] = set()  # event ids refused here or marked refused by another replica
        while True:
            plan = [e for e in replay_plan(history, start, refused) if e.policy_version > self._applier.policy_version]
            if not plan:
                return
            log.info("policy follower: catching up with versions %s", [e.policy_version for e in plan])
            for event in plan:
                mark = await _marked_refused(js, event)
                if mark is not None:
                    log.info(
                        "policy follower: version %d skipped: refused by replica %s (%s: %s)",
                        event.policy_version, mark[1], mark[0], mark[2],
                    )  # fmt: skip
                    refused.add(event.event_id)
                    break
                if await self._apply(js, event, quiet_if_old=True) != "applied":
                    refused.add(event.event_id)
                    break
            else:
                return

    async def _apply(self, js: JetStreamContext, event: PolicyUpdated, *, quiet_if_old: bool = False) -> str:
        """Download and apply one base version: ``"applied"``, ``"rejected"`` or ``"skipped"`` (old,
        seen before). A version refused for good is marked refused in the object store."""
        applier = self._applier
        if quiet_if_old and event.policy_version <= applier.policy_version:
            return "skipped"
        self._handled.add(event.event_id)
        if applier.remote and not applier.reloads_servers:
            # The servers' weights are the trainer's to change: follow the version, download nothing.
            try:
                await applier.apply_directory(event.weights or "", event.policy_version, source="nats")
            except (PolicyNotNewer, WeightsRejected):  # both reported by the applier
                return "rejected"
            return "applied"
        if applier.reloads_servers and not event.full:
            detail = "a server reloads whole checkpoints: publish full versions for --upstream-weights reload"
            applier.reject(event.policy_version, "unsupported", detail)
            return "rejected"
        directory = Path(tempfile.mkdtemp(prefix="sg-policy-", dir=self._download_dir))
        kept = False
        try:
            started = time.perf_counter()
            try:
                await download_policy(js, event, directory)
            except PolicyDownloadError as exc:
                applier.reject(event.policy_version, exc.reason, str(exc))
                if exc.reason in _REFUSED_FOR_GOOD:
                    await self._mark(js, event, exc.reason, str(exc))
                return "rejected"
            download_s = time.perf_counter() - started
            try:
                await applier.apply_directory(directory, event.policy_version, source="nats", download_s=download_s)
            except PolicyNotNewer:
                return "rejected"  # reported by the applier
            except WeightsRejected as exc:  # reported by the applier
                if exc.reason in _REFUSED_FOR_GOOD:
                    await self._mark(js, event, exc.reason, str(exc))
                return "rejected"
            except Exception as exc:  # the engine failed: keep following, say so
                applier.reject(event.policy_version, "engine", f"{type(exc).__name__}: {exc}")
                return "rejected"
            if applier.reloads_servers:  # a server that restarts loads it again: kept until the next one
                kept, previous, self._kept = True, self._kept, directory
                if previous is not None:
                    await anyio.to_thread.run_sync(shutil.rmtree, previous, True)
            return "applied"
        finally:
            if not kept:
                await anyio.to_thread.run_sync(shutil.rmtree, directory, True)

    async def _mark(self, js: JetStreamContext, event: PolicyUpdated, reason: str, detail: str) -> None:
        try:
            if await mark_refused(js, event, reason, detail, self._applier.replica):
                log.info("policy follower: version %d marked refused in the policy store", event.policy_version)
        except Exception as exc:  # best effort: the refusal itself is reported already
            log.warning("policy follower: could not mark version %d refused: %s", event.policy_version, exc)

    async def _catch_up_adapters(self, js: JetStreamContext) -> None:
        """Every adapter in the history to its newest version that applies: the newest first, then
        (if refused) the one before it, down to the version in service."""
        try:
            history = await policy_history(js, self._spec, adapters=True)
        except Exception as exc:  # NATS went away: follow live updates only
            log.warning("policy follower: could not read the adapters' history (%s); following new updates", exc)
            return
        by_name: dict[str, dict[int, PolicyUpdated]] = {}
        for event in history:  # oldest first: a version published twice keeps its last event
            if event.adapter is not None:
                by_name.setdefault(event.adapter, {})[event.policy_version] = event
        for name, versions in by_name.items():
            current = self._applier.adapter_version(name)
            plan = [versions[v] for v in sorted(versions, reverse=True) if current is None or v > current]
            if plan:
                log.info(
                    "policy follower: adapter %s catching up (versions %s)", name, [e.policy_version for e in plan]
                )
            for event in plan:
                outcome = await self._apply_adapter(js, event, quiet_if_old=True)
                if outcome != "rejected":  # applied, or an engine that takes no adapters: done with this one
                    break

    async def _apply_adapter(self, js: JetStreamContext, event: PolicyUpdated, *, quiet_if_old: bool = False) -> str:
        """Download and apply one adapter version: ``"applied"``, ``"rejected"``, ``"skipped"``
        (old, seen before) or ``"unsupported"`` (an engine without LoRA)."""
        from stream_gateway._errors import AdapterRefused

        applier = self._applier
        name = event.adapter
        assert name is not None
        current = applier.adapter_version(name)
        if quiet_if_old and current is not None and event.policy_version <= current:
            return "skipped"
        self._handled.add(event.event_id)
        if not applier.takes_downloaded_adapters:  # reported as unsupported, nothing downloaded
            log.warning(
                "policy follower: adapter %s version %d skipped: this engine cannot load a downloaded adapter",
                name,
                event.policy_version,
            )
            applier.reject(
                event.policy_version,
                "unsupported",
                f"the {applier.engine_name} engine cannot load an adapter downloaded from NATS",
                adapter=name,
            )
            return "unsupported"
        directory = Path(tempfile.mkdtemp(prefix="sg-adapter-", dir=self._download_dir))
        try:
            started = time.perf_counter()
            try:
                await download_policy(js, event, directory)
            except PolicyDownloadError as exc:
                applier.reject(event.policy_version, exc.reason, str(exc), adapter=name)
                return "rejected"
            download_s = time.perf_counter() - started
            try:
                await applier.apply_adapter(name, directory, event.policy_version, source="nats", download_s=download_s)
            except AdapterRefused as exc:
                return "unsupported" if exc.reason == "unsupported" else "rejected"  # reported by the applier
            except PolicyNotNewer:
                return "rejected"
            except Exception as exc:  # the engine failed: keep following, say so
                applier.reject(event.policy_version, "engine", f"{type(exc).__name__}: {exc}", adapter=name)
                return "rejected"
            return "applied"
        finally:
            await anyio.to_thread.run_sync(shutil.rmtree, directory, True)
