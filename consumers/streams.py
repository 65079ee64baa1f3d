"""Names of what the consumers publish, and their provisioning.

::

    sg.trajectories.<tenant>.<session>   SG_TRAJECTORIES   one message per trajectory (Nats-Msg-Id = its id)
    sg.batches.ready                     SG_BATCHES        one manifest per training batch (Nats-Msg-Id = batch id)
    object store sg_batches              <batch id>.parquet, the batch itself
    KV sg_scores                         <tenant>.<session>.<trajectory id>.<scorer>: the reward worker's scores
                                         (consumers.scores; kept as long as the trajectories stream keeps one)
    object store sg_images               read only: images/<sha256> and processors/<fingerprint>, the
                                         gateway's (consumers.images); never created here

Trajectories over the server's max payload travel like oversized events: in the
``sg_payloads`` object store, with a pointer message (``pipeline.durable.publish_durable``).

``replicas`` (``--stream-replicas``): each stream and bucket above is created with, and an existing
one brought to, that many replicas; ``None`` creates what is missing with one and leaves the count
of what exists alone (``pipeline.streams``), so that a consumer started without the flag never
scales a cluster's streams down. The events stream is only created here, never changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.events import subject_token
from pipeline.streams import (
    StreamSpec,
    ensure_bucket,
    ensure_key_value,
    ensure_named_stream,
    ensure_stream,
    keep_for,
)

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from .trajectory import Trajectory

__all__ = ["ConsumerStreams", "ensure_consumer_streams"]


@dataclass(frozen=True, slots=True)
class ConsumerStreams:
    """Stream, subject and bucket names of the consumers' outputs (and the events they read)."""

    prefix: str = "sg"
    events: str = "SG_EVENTS"
    trajectories: str = "SG_TRAJECTORIES"
    batches: str = "SG_BATCHES"
    payload_bucket: str = "sg_payloads"  # oversized messages (shared with the gateway's events)
    batch_bucket: str = "sg_batches"
    state_bucket: str = "sg_assembler"  # the assembler's per-session state (JetStream KV)
    score_bucket: str = "sg_scores"  # the reward worker's scores, one key per trajectory and scorer (JetStream KV)
    image_bucket: str = "sg_images"  # the gateway's images and their processors (pipeline.streams.StreamSpec)
    replicas: int | None = None  # None: one for what is created, what exists keeps its own (module docstring)
    duplicate_window_s: float = 600.0
    # Retention (docs/data-rights.md): how long the trajectories stream keeps a message, and the
    # batches stream and bucket a batch; None: not set here (a new one keeps everything), 0: forever.
    trajectories_max_age_s: float | None = None
    batches_max_age_s: float | None = None

    @property
    def event_subjects(self) -> str:
        return f"{self.prefix}.events.>"

    @property
    def trajectory_subjects(self) -> str:
        return f"{self.prefix}.trajectories.>"

    @property
    def batch_subject(self) -> str:
        return f"{self.prefix}.batches.ready"

    @property
    def pending_subject(self) -> str:
        """Where ``stream-gateway pending`` asks the assemblers and batchers what they wait for."""
        return f"{self.prefix}.control.pending"

    @property
    def flush_subject(self) -> str:
        """Where ``stream-gateway flush`` asks the batchers for the partial batches they hold."""
        return f"{self.prefix}.control.batcher.flush"

    def trajectory_subject(self, trajectory: Trajectory) -> str:
        """Where one trajectory is published."""
        return f"{self.prefix}.trajectories.{subject_token(trajectory.tenant)}.{subject_token(trajectory.session_id)}"


async def ensure_consumer_streams(js: JetStreamContext, names: ConsumerStreams) -> None:
    """Create (or update) the trajectory and batch streams, the buckets, and a missing events stream."""
    from nats.js.errors import NotFoundError

    try:
        await js.stream_info(names.events)
    except NotFoundError:  # consumers started before any gateway: create it as a gateway would
        await ensure_stream(js, StreamSpec(prefix=names.prefix, stream=names.events, replicas=names.replicas))
    for stream, subject, max_age_s in (
        (names.trajectories, names.trajectory_subjects, names.trajectories_max_age_s),
        (names.batches, names.batch_subject, names.batches_max_age_s),
    ):
        await ensure_named_stream(
            js,
            stream,
            [subject],
            replicas=names.replicas,
            max_age_s=max_age_s,
            duplicate_window_s=names.duplicate_window_s,
        )
    await ensure_bucket(js, names.payload_bucket, replicas=names.replicas)
    await ensure_bucket(js, names.batch_bucket, replicas=names.replicas, max_age_s=names.batches_max_age_s)
    await ensure_key_value(js, names.state_bucket, replicas=names.replicas)
    await ensure_key_value(js, names.score_bucket, replicas=names.replicas)
    if names.trajectories_max_age_s is not None:  # a trajectory's scores are kept as long as it is
        await keep_for(js, f"KV_{names.score_bucket}", names.trajectories_max_age_s)
