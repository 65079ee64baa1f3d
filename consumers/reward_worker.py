"""The reward worker: trajectories in, one score per scorer out, on as many replicas as the scorers need.

``stream-gateway reward --scorer NAME=SPEC ...`` reads ``SG_TRAJECTORIES`` through one durable pull
consumer (``rewarder``) that every replica binds (:mod:`consumers._runner`): JetStream hands each
trajectory to one replica. For each scorer (:mod:`consumers.scorers`, :mod:`consumers.judge`) that
has no record of the trajectory yet, the worker runs it and records its verdict (a score, a timeout,
an error) in the ``sg_scores`` bucket (:mod:`consumers.scores`), then acknowledges the message. The
batcher turns the scores into rewards (its ``--reward``; :mod:`consumers._score_gate`).

Once per scorer, under crashes and redeliveries:

* a record is written with ``kv.create``, which fails if the key exists: two replicas that scored
  the same trajectory (a redelivery racing a slow first delivery) leave one record, the first
  (``duplicate`` in the statistics for the other);
* a scorer with a record is not run again (``already``): a message redelivered after a crash
  between some scorers' records and the acknowledgement runs only the scorers still missing;
* a message is acknowledged only once every scorer has a record, so a replica killed mid-way loses
  nothing: its unacknowledged messages come back to a replica after ``ack_wait_s``. While a
  trajectory is being scored the worker tells JetStream every ``ack_wait_s / 3`` that it is still at
  it (``in_progress``), so a slow judge does not cause a redelivery.

Revisions of a trajectory (late feedback) arrive as messages of their own and find their scores
recorded: the scorers read what a revision does not change. Trajectories of a forgotten session
(``stream-gateway forget``) are acknowledged unscored, and a verdict reached after its session was
forgotten is not recorded (the tombstones are followed live; erasure's second sweep takes what a
worker wrote before it learned one).

At most ``max_in_flight`` trajectories are in hand at once (fetches ask for the free room only, so
replicas share the work evenly); each scorer's ``concurrency`` bounds its own tries. With
``metrics_port``, ``GET /metrics`` serves the counters in Prometheus' text format (see
:meth:`RewardWorker.metrics`). Throughput per replica and its scaling: ``benchmarks/reward_worker.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from anyio.abc import TaskGroup, TaskStatus
from pipeline.connection import NatsAuth
from pipeline.subscriber import message_payload
from pipeline.tombstones import Tombstones

from ._runner import DurableRunner, PullSpec
from .judge import JudgeScorer, load_template
from .scorers import Scorer, ScorerSpec, Tokenizers, Verdict, scoring_document
from .scores import ScoreRecord, score_key
from .streams import ConsumerStreams
from .trajectory import erased

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["RewardWorker", "RewardWorkerConfig", "RewardWorkerStatistics", "ScorerStatistics", "run_reward_worker"]

_SCORERS = {"python": Scorer.python, "command": Scorer.command, "signals": Scorer.signals}  # judges: opened

log = logging.getLogger(__name__)

_FETCH_WAIT_S = 1.0
_RESTART_S = 1.0
OUTCOMES = ("scored", "timeout", "error", "already", "duplicate")


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, slots=True)
class RewardWorkerConfig:
    """What one replica scores, and how."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    scorers: tuple[ScorerSpec, ...] = ()
    durable: str = "rewarder"  # replicas with one name share the work
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> tokenizer dir ("": every model)
    judge_template: str | None = None  # a file; None: consumers.judge.DEFAULT_TEMPLATE
    judge_api_key: str | None = None
    judge_max_tokens: int = 512
    ack_wait_s: float = 30.0
    max_in_flight: int = 32
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics; 0: any free port
    worker: str = field(default_factory=_worker_id)
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.scorers]
        if not names:
            raise ValueError("no scorer: give --scorer NAME=SPEC")
        if len(set(names)) != len(names):
            raise ValueError(f"two scorers share a name: {names}")
        if any(spec.kind == "judge" for spec in self.scorers) and not self.tokenizers:
            raise ValueError("a judge reads the trajectory as text: give --tokenizer [MODEL=]DIR")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")


@dataclass(frozen=True, slots=True)
class ScorerStatistics:
    """One scorer's counters on this replica (``already``/``duplicate``: module docstring)."""

    scored: int = 0
    timeout: int = 0
    error: int = 0
    already: int = 0
    duplicate: int = 0
    attempts: int = 0
    seconds: float = 0.0  # from first try to verdict, summed over recorded verdicts


@dataclass(frozen=True, slots=True)
class RewardWorkerStatistics:
    """Counters since start (messages: a redelivery counts again)."""

    trajectories: int
    undecodable: int
    erased: int
    in_flight: int
    scorers: dict[str, ScorerStatistics]


@dataclass(slots=True)
class _Work:
    js: JetStreamContext
    kv: KeyValue
    scorers: list[Scorer]


class RewardWorker:
    """One replica; ``await run()`` until cancelled (``tg.start(worker.run)`` waits until it consumes)."""

    def __init__(self, config: RewardWorkerConfig, progress: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._progress = progress
        self._template = load_template(config.judge_template)
        self._tokenizers = Tokenizers(config.tokenizers)
        self._tombstones = Tombstones(config.names.prefix, replicas=config.names.replicas)
        self._counts = {"trajectories": 0, "undecodable": 0, "erased": 0}
        self._scorer_counts: dict[str, dict[str, float]] = {
            spec.name: dict.fromkeys((*OUTCOMES, "attempts", "seconds"), 0) for spec in config.scorers
        }
        self._in_flight = 0
        spec = PullSpec(
            stream=config.names.trajectories,
            subjects=config.names.trajectory_subjects,
            durable=config.durable,
            ack_wait_s=config.ack_wait_s,
            max_ack_pending=max(config.max_in_flight * 16, 1024),
            fetch_timeout_s=_FETCH_WAIT_S,
            sole_reader=False,  # replicas share the durable
            ride_out_disconnects=False,  # what is in hand is redelivered; the run starts again
        )
        self._runner = DurableRunner(
            spec, servers=config.servers, auth=config.auth, names=config.names, role="rewarder", log=log
        )

    def statistics(self) -> RewardWorkerStatistics:
        """A snapshot of the counters."""
        return RewardWorkerStatistics(
            **self._counts,
            in_flight=self._in_flight,
            scorers={name: _scorer_statistics(counts) for name, counts in self._scorer_counts.items()},
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Score until cancelled."""
        config = self._config
        async with AsyncExitStack() as stack:
            scorers = []
            for spec in config.scorers:
                if spec.kind == "judge":
                    judge = JudgeScorer(spec, self._template, api_key=config.judge_api_key,
                                        max_tokens=config.judge_max_tokens)  # fmt: skip
                    scorers.append(await stack.enter_async_context(judge.open()))
                else:
                    scorers.append(_SCORERS[spec.kind](spec))
            _, js = await stack.enter_async_context(self._runner.connected())
            kv = await js.key_value(config.names.score_bucket)  # provisioned with the consumers' streams
            subscription = await self._runner.bind(js)
            await self._tombstones.load(js)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tombstones.follow, js)
                if self._progress is not None:
                    tg.start_soon(self._progress_loop)
                task_status.started()
                await self._consume(tg, _Work(js, kv, scorers), subscription)

    async def _consume(self, tg: TaskGroup, work: _Work, subscription: Any) -> None:
        """Fetch as many trajectories as there is room for, score each in a task of its own, forever."""
        slots = anyio.Semaphore(self._config.max_in_flight)
        while True:
            await slots.acquire()  # room for one at least
            messages = await self._runner.fetch(subscription, slots.value + 1, _FETCH_WAIT_S)
            if not messages:
                slots.release()
                continue
            for _ in messages[1:]:
                slots.acquire_nowait()  # there was room for them all
            for msg in messages:
                tg.start_soon(self._one, work, msg, slots)

    async def _one(self, work: _Work, msg: Msg, slots: anyio.Semaphore) -> None:
        """Score one trajectory with each scorer that has no record of it; then acknowledge it."""
        import nats.errors

        self._in_flight += 1
        try:
            await self._score_message(work, msg)
        except (nats.errors.Error, TimeoutError) as exc:  # not acknowledged: delivered again later
            log.warning("rewarder: trajectory message %s put aside (%r)", msg.metadata.sequence.stream, exc)
        finally:
            self._in_flight -= 1
            slots.release()

    async def _score_message(self, work: _Work, msg: Msg) -> None:
        self._counts["trajectories"] += 1
        try:
            trajectory = orjson.loads(await message_payload(msg, work.js))
            tid, session_id, tenant = trajectory["trajectory_id"], trajectory["session_id"], trajectory["tenant"]
        except (LookupError, ValueError, TypeError) as exc:
            log.error("rewarder: undecodable trajectory message %s: %r", msg.metadata.sequence.stream, exc)
            self._counts["undecodable"] += 1
            await msg.ack()
            return
        if erased(self._tombstones, tenant, session_id):
            self._counts["erased"] += 1
            await msg.ack()
            return
        keys = {scorer.name: score_key(tenant, session_id, tid, scorer.name) for scorer in work.scorers}
        todo = [scorer for scorer in work.scorers if not await _recorded(work.kv, keys[scorer.name])]
        for scorer in work.scorers:
            if scorer not in todo:
                self._scorer_counts[scorer.name]["already"] += 1
        if todo:
            try:
                document = scoring_document(trajectory, await self._tokenizers.get(str(trajectory.get("model"))))
            except (LookupError, ValueError, TypeError, OSError) as exc:  # no tokenizer there, ids it does not know
                log.error("rewarder: trajectory %s has no text: %r", tid, exc)
                document = trajectory
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_alive, msg)
                async with anyio.create_task_group() as scoring:
                    for scorer in todo:
                        scoring.start_soon(self._score, work, scorer, document, keys[scorer.name])
                tg.cancel_scope.cancel()
        await msg.ack()

    async def _keep_alive(self, msg: Msg) -> None:
        import nats.errors

        while True:
            await anyio.sleep(max(0.05, self._config.ack_wait_s / 3))
            try:
                await msg.in_progress()
            except nats.errors.Error as exc:  # disconnected: a redelivery finds the records written
                log.debug("rewarder: in_progress failed: %r", exc)

    async def _score(self, work: _Work, scorer: Scorer, document: dict[str, Any], key: str) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        verdict = await scorer.run(document)
        if erased(self._tombstones, document["tenant"], document["session_id"]):  # forgotten while it ran
            return
        record = _record(document, scorer, verdict, self._config.worker)
        counts = self._scorer_counts[scorer.name]
        try:
            await work.kv.create(key, record.encode())
        except KeyWrongLastSequenceError:  # another replica recorded it first; its record stands
            counts["duplicate"] += 1
            return
        counts[verdict.status] += 1
        counts["attempts"] += verdict.attempts
        counts["seconds"] += verdict.duration_s
        if verdict.status != "scored":
            log.warning("rewarder: %s on %s: %s (%s)", scorer.name, record.trajectory_id, verdict.status, verdict.error)

    async def _progress_loop(self) -> None:
        assert self._progress is not None
        last = ""
        while True:
            await anyio.sleep(self._config.progress_interval_s)
            s = self.statistics()
            line = f"rewarder: {s.trajectories} trajectories, {s.in_flight} in hand; " + "; ".join(
                f"{name} {c.scored} scored, {c.timeout} timed out, {c.error} failed" for name, c in s.scorers.items()
            )
            if line != last:  # an idle worker says nothing new
                last = line
                self._progress(line)

    def metrics(self) -> str:
        """The counters in Prometheus' text format (``GET /metrics``)."""
        s = self.statistics()
        scorers = s.scorers.items()
        lines = [
            "# HELP sg_reward_trajectories_total Trajectory messages this worker handled (a redelivery counts again).",
            "# TYPE sg_reward_trajectories_total counter", f"sg_reward_trajectories_total {s.trajectories}",
            "# HELP sg_reward_trajectories_skipped_total Trajectory messages acknowledged unscored, by reason.",
            "# TYPE sg_reward_trajectories_skipped_total counter",
            f'sg_reward_trajectories_skipped_total{{reason="undecodable"}} {s.undecodable}',
            f'sg_reward_trajectories_skipped_total{{reason="erased"}} {s.erased}',
            "# HELP sg_reward_in_flight Trajectories being scored now.", "# TYPE sg_reward_in_flight gauge",
            f"sg_reward_in_flight {s.in_flight}",
            "# HELP sg_reward_scores_total Verdicts per scorer: scored, timeout, error (recorded by this worker); "
            "already (recorded before: not run again), duplicate (another worker recorded it first).",
            "# TYPE sg_reward_scores_total counter",
            *(f'sg_reward_scores_total{{scorer="{name}",outcome="{outcome}"}} {getattr(c, outcome)}'
              for name, c in scorers for outcome in OUTCOMES),
            "# HELP sg_reward_attempts_total Tries of each scorer behind its recorded verdicts, retries included.",
            "# TYPE sg_reward_attempts_total counter",
            *(f'sg_reward_attempts_total{{scorer="{name}"}} {c.attempts}' for name, c in scorers),
            "# HELP sg_reward_score_seconds Seconds from a scorer's first try to its recorded verdict.",
            "# TYPE sg_reward_score_seconds summary",
            *(line for name, c in scorers for line in (
                f'sg_reward_score_seconds_sum{{scorer="{name}"}} {c.seconds:.6f}',
                f'sg_reward_score_seconds_count{{scorer="{name}"}} {c.scored + c.timeout + c.error}',
            )),
        ]  # fmt: skip
        return "\n".join(lines) + "\n"


def _scorer_statistics(counts: dict[str, float]) -> ScorerStatistics:
    return ScorerStatistics(
        **{name: int(counts[name]) for name in (*OUTCOMES, "attempts")}, seconds=round(counts["seconds"], 6)
    )


def _record(document: dict[str, Any], scorer: Scorer, verdict: Verdict, worker: str) -> ScoreRecord:
    value = verdict.value
    turn_ids = [turn["turn_id"] for turn in document["turns"]]
    turns = {} if value is None or value.turns is None else {
        turn_id: score for turn_id, score in zip(turn_ids, value.turns, strict=True) if score is not None
    }  # fmt: skip
    return ScoreRecord(
        trajectory_id=document["trajectory_id"], session_id=document["session_id"], tenant=document["tenant"],
        scorer=scorer.name, kind=scorer.spec.kind, status=verdict.status,
        score=None if value is None else value.score, parts={} if value is None else value.parts, turns=turns,
        answer=None if value is None else value.answer, error=verdict.error, attempts=verdict.attempts,
        duration_s=verdict.duration_s, worker=worker, at=time.time(),
    )  # fmt: skip


async def _recorded(kv: KeyValue, key: str) -> bool:
    from nats.js.errors import KeyNotFoundError

    try:
        await kv.get(key)
    except KeyNotFoundError:
        return False
    return True


async def serve_metrics(
    render: Callable[[], str], host: str, port: int, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``GET /metrics`` (``render()``) on ``host:port`` (0: a free port) until cancelled; starts
    with its URL once the socket listens. A port taken fails at once (``OSError``)."""
    import contextlib

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(render(), media_type="text/plain; version=0.0.4")

    class Server(uvicorn.Server):  # no signal handlers of its own: the process's owner cancels it
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(64)
        server = Server(uvicorn.Config(Starlette(routes=[Route("/metrics", metrics)]), log_level="warning",
                                       lifespan="off"))  # fmt: skip
        task_status.started(f"http://{host}:{sock.getsockname()[1]}/metrics")
        try:
            await server.serve(sockets=[sock])
        finally:
            server.should_exit = True
    finally:
        sock.close()


async def run_reward_worker(config: RewardWorkerConfig, progress: Callable[[str], None] | None = None) -> None:
    """Run one replica, and its ``/metrics`` with ``metrics_port``, until cancelled.

    A NATS error that ends a run starts the next a second later (what it had in hand is delivered
    again); the counters and ``/metrics`` carry on across runs.
    """
    import nats.errors

    worker = RewardWorker(config, progress)
    async with anyio.create_task_group() as tg:
        if config.metrics_port is not None:
            try:
                url = await tg.start(serve_metrics, worker.metrics, config.metrics_host, config.metrics_port)
                said = f"metrics at {url}"
            except OSError as exc:  # the port taken: scoring matters more than its counters
                said = f"no /metrics on port {config.metrics_port} ({exc}); scoring without it"
            if progress is not None:
                progress(f"rewarder: {said}")
        while True:
            try:
                await worker.run()
            except* (nats.errors.Error, TimeoutError, ConnectionResetError) as group:  # a refusal: exit
                log.warning("rewarder: NATS failed (%r); starting again in %.0f s", group.exceptions[0], _RESTART_S)
            await anyio.sleep(_RESTART_S)
