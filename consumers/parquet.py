"""The batch artifact: a parquet file of trajectories, and the manifest that announces it.

A training batch is stored once, as parquet (the canonical artifact: the object
``<batch id>.parquet`` in the ``sg_batches`` object store, and optionally the same bytes in a
directory), and announced by a small JSON :class:`BatchManifest` on ``sg.batches.ready``.

One row per trajectory, in batch order (groups one after another, each group's members in
arrival order), with every :class:`~consumers.trajectory.Trajectory` field plus the ``uid``
its GRPO group has in this batch, so :func:`decode_batch` rebuilds the trajectories exactly::

    uid              string        the group's id in this batch (verl's ``uid``)
    trajectory_id    string
    session_id, tenant, model, agent (nullable), emitted_because, reward_source (nullable)
    adapter          string (nullable)  the LoRA adapter that sampled the row; null: the base model
    token_ids        list<int32>   prompt + response ids
    loss_mask        list<int8>    1 on sampled ids
    logprobs         list<double>  the sampling logprobs (0.0 where not sampled), exact
    reasoning_mask   list<int8>    1 on sampled ids that are thinking (in loss_mask too), 0 elsewhere
    routed_experts         large_binary (nullable)  a mixture-of-experts model's routes: the raw C-order
                   bytes of the ``[len(token_ids) - 1, layers, top_k]`` array (not base64); null: none
    routed_experts_shape   list<int32> (nullable)   that array's shape
    routed_experts_dtype   string (nullable)        ``uint8`` or ``uint16``
    token_policy_versions  list<int32>  the policy version that sampled each id (-1 where not sampled),
                   derived from ``turns`` (whose spans are the record) for readers of the parquet alone
    images         list<struct>  a vision-language model's images in prompt order (empty: none), each
                   {sha256, media_type, width, height, start, tokens, grid_thw list<int32>,
                   pixels_sha256, processor}: :class:`~consumers.trajectory.TrajectoryImage`; the
                   bytes stay in the ``sg_images`` bucket (:mod:`consumers.images`)
    prompt_length, num_turns, min_policy_version, max_policy_version   int64
    reward           double (nullable)
    aborted, truncated, complete   bool
    abort_reason     string (nullable)  why the last turn did not finish
    revision         int64         0, or the late-reward revision the row was batched at
    continues_turn_id  string (nullable)  the turn its conversation continues after a compaction
    end_reason       string (nullable)  why the trajectory ends (:data:`~consumers.trajectory.END_REASONS`)
    health           list<string>  record-health flags (:data:`~consumers.trajectory.HEALTH_FLAGS`)
    started_at, ended_at           double (Unix seconds)
    metadata, turns                string (JSON)
    schema_version                 int8

The file's key-value metadata carries ``sg.batch_id``, ``sg.prompt_length`` and
``sg.response_length``. Logprobs stay float64 (not verl's float32) so a row equals the
trajectory it came from; the padded tensors are cast when the batch is built. A file written
before ``reasoning_mask`` (trajectory schema 2) still reads, with no thinking (all 0), and one
written before ``routed_experts`` (schema 3) with no routes, and one written before ``adapter``
with the base model's rows (null), and one written before ``images`` (schema 4) with none. A
batch holds one adapter's rows (the batcher never mixes
them), and its manifest names that adapter (``adapter``, left out for the base model, so a base
model's manifest is what it was before adapters and still reads in an older trainer).

pyarrow is imported lazily: it comes with the ``verl`` extra.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from .trajectory import ExpertRoutes, Trajectory

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["MANIFEST_SCHEMA_VERSION", "BatchManifest", "decode_batch", "encode_batch", "require_pyarrow"]

MANIFEST_SCHEMA_VERSION: Literal[1] = 1

_JSON_COLUMNS = ("metadata", "turns")
_ROUTE_COLUMNS = ("routed_experts", "routed_experts_shape", "routed_experts_dtype")


class BatchManifest(BaseModel):
    """What ``sg.batches.ready`` carries for each batch (``Nats-Msg-Id`` = ``batch_id``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = MANIFEST_SCHEMA_VERSION
    batch_id: str = Field(description="sha256 of the sorted member trajectory ids")
    bucket: str = Field(description="the object store holding the parquet")
    object: str = Field(description="the parquet's object name, '<batch_id>.parquet'")
    size: int = Field(ge=0, description="the parquet's size in bytes")
    sha256: str = Field(description="hex digest of the parquet bytes")
    group_size: int = Field(ge=1)
    groups: list[str] = Field(description="the groups' uids in batch order; group i is rows i*group_size onwards")
    trajectory_ids: list[str] = Field(description="the rows' trajectory ids, in order")
    min_policy_version: int
    max_policy_version: int
    prompt_length: int = Field(description="the batcher's prompt_length (every row's prompt fits)")
    response_length: int = Field(description="the batcher's response_length (every row's response fits)")
    created_at: float = Field(description="when the batch was first assembled, Unix seconds")
    adapter: str | None = Field(
        None,
        description="the LoRA adapter of every row (a batch never mixes adapters); null or absent: the base model",
    )
    logprob_coverage: list[float] = Field(
        default_factory=list,
        description="per row, in order: the fraction of its sampled ids with a finite recorded logprob (1.0: all); "
        "empty in manifests written before it",
    )
    version_lag: list[int] = Field(
        default_factory=list,
        description="per row: max_policy_version minus the row's min_policy_version, the versions its oldest "
        "token is behind the batch's newest (a trainer adds its own lead over max_policy_version); empty before it",
    )

    def encode(self) -> bytes:
        """The wire form: compact JSON (``adapter`` left out for the base model)."""
        data = self.model_dump(mode="python")
        if data["adapter"] is None:
            del data["adapter"]
        return orjson.dumps(data)

    @classmethod
    def decode(cls, data: bytes | str) -> BatchManifest:
        """Parse and validate."""
        return cls.model_validate_json(data)


def require_pyarrow() -> None:
    """Fail now, clearly, if pyarrow (the ``verl`` extra) is missing, rather than at the first batch."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "batches are written as parquet, which needs pyarrow: pip install 'stream-gateway[verl]' (or pyarrow)"
        ) from exc


def _schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("uid", pa.string()),
            ("trajectory_id", pa.string()),
            ("session_id", pa.string()),
            ("tenant", pa.string()),
            ("model", pa.string()),
            ("agent", pa.string()),
            ("token_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float64())),
            ("reasoning_mask", pa.list_(pa.int8())),
            ("images", pa.list_(_image_struct())),
            ("routed_experts", pa.large_binary()),  # large: a batch's routes can pass 2 GiB
            ("routed_experts_shape", pa.list_(pa.int32())),
            ("routed_experts_dtype", pa.string()),
            ("token_policy_versions", pa.list_(pa.int32())),
            ("prompt_length", pa.int64()),
            ("num_turns", pa.int64()),
            ("min_policy_version", pa.int64()),
            ("max_policy_version", pa.int64()),
            ("reward", pa.float64()),
            ("reward_source", pa.string()),
            ("adapter", pa.string()),
            ("aborted", pa.bool_()),
            ("abort_reason", pa.string()),
            ("end_reason", pa.string()),
            ("revision", pa.int64()),
            ("continues_turn_id", pa.string()),
            ("health", pa.list_(pa.string())),
            ("truncated", pa.bool_()),
            ("complete", pa.bool_()),
            ("emitted_because", pa.string()),
            ("started_at", pa.float64()),
            ("ended_at", pa.float64()),
            ("metadata", pa.string()),
            ("turns", pa.string()),
            ("schema_version", pa.int8()),
        ]
    )


def _image_struct() -> pa.DataType:
    import pyarrow as pa

    return pa.struct(
        [
            ("sha256", pa.string()),
            ("media_type", pa.string()),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("start", pa.int64()),
            ("tokens", pa.int64()),
            ("grid_thw", pa.list_(pa.int32())),
            ("pixels_sha256", pa.string()),
            ("processor", pa.string()),
        ]
    )


def encode_batch(
    trajectories: list[Trajectory], uids: list[str], *, batch_id: str, prompt_length: int, response_length: int
) -> bytes:
    """The parquet bytes of one batch (rows in the given order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if len(trajectories) != len(uids):
        raise ValueError(f"{len(trajectories)} trajectories but {len(uids)} uids")
    rows: list[dict[str, Any]] = []
    for trajectory, uid in zip(trajectories, uids, strict=True):
        row = trajectory.model_dump(mode="python")
        for column in _JSON_COLUMNS:
            row[column] = orjson.dumps(row[column], option=orjson.OPT_SORT_KEYS).decode()
        row["uid"] = uid
        row["token_policy_versions"] = trajectory.token_policy_versions()
        row.update(_route_columns(trajectory.routed_experts))
        rows.append(row)
    schema = _schema().with_metadata(
        {
            "sg.batch_id": batch_id,
            "sg.prompt_length": str(prompt_length),
            "sg.response_length": str(response_length),
        }
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_batch(data: bytes) -> tuple[list[Trajectory], list[str]]:
    """The trajectories of a batch's parquet, and their uids, in row order."""
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(data))
    trajectories: list[Trajectory] = []
    uids: list[str] = []
    for row in table.to_pylist():
        uids.append(row.pop("uid"))
        row.pop("token_policy_versions", None)  # derived; absent from batches written before it
        row["images"] = row.get("images") or []  # absent from batches written before images
        row["health"] = row.get("health") or []  # absent from batches written before health flags
        row["revision"] = row.get("revision") or 0
        row["routed_experts"] = _routes(*(row.pop(column, None) for column in _ROUTE_COLUMNS))
        for column in _JSON_COLUMNS:
            row[column] = orjson.loads(row[column])
        trajectories.append(Trajectory.model_validate(row))
    return trajectories, uids


def _route_columns(routes: ExpertRoutes | None) -> dict[str, Any]:
    if routes is None:
        return dict.fromkeys(_ROUTE_COLUMNS)
    return {
        "routed_experts": base64.b64decode(routes.data),
        "routed_experts_shape": list(routes.shape),
        "routed_experts_dtype": routes.dtype,
    }


def _routes(data: bytes | None, shape: list[int] | None, dtype: str | None) -> ExpertRoutes | None:
    """The routes of a row's three columns (all null: none, as in files written before them)."""
    if data is None:
        return None
    return ExpertRoutes.model_validate({"shape": shape, "dtype": dtype, "data": base64.b64encode(data).decode("ascii")})
