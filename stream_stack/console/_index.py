"""The console's index: a SQLite projection of the durable streams, rebuilt from them at will.

The console never reads a gateway's memory. It follows the events stream (sessions, turns,
feedback, policy versions), the trajectories stream (chains, their health, rewards) and the
batches stream (which trajectory went into which batch) from where it last stopped, and keeps
what its pages filter and page on here: one row per session, turn, trajectory and batch. The
token ids themselves stay in the streams: a turn or trajectory row keeps the stream sequence of
its message, read back (:mod:`._feed`) when a page shows its tokens.

Deleting the file loses nothing: the next start reads the streams from the beginning again (and
what retention already removed from them is gone from the index too). A forgotten session
(``stream-gateway forget``, or the console's own forget) is removed from the index when its
tombstone is seen, and never indexed again.

Tenants are the events' tenant ids (:func:`pipeline.events.tenant_id`): the console maps a
signed-in key to one the way the gateway does, so a tenant's pages hold exactly its sessions.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from consumers.signals import SIGNALS
from pipeline.events import (
    Event,
    FeedbackRecorded,
    PolicyApplied,
    SessionClosed,
    SessionOpened,
    TurnAborted,
    TurnCompleted,
    TurnRecord,
    TurnStarted,
)

__all__ = ["PAGE_LIMIT", "ConsoleIndex", "SessionFilter"]

PAGE_LIMIT = 200  # the most rows one page returns, whatever a request asks

_SCHEMA = """
PRAGMA journal_mode = WAL;
PRAGMA synchronous = NORMAL;
CREATE TABLE IF NOT EXISTS position (stream TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, model TEXT, agent TEXT, adapter TEXT,
    metadata TEXT, opened_at REAL, last_at REAL NOT NULL, closed TEXT, turns INTEGER NOT NULL DEFAULT 0,
    live INTEGER NOT NULL DEFAULT 0, health TEXT NOT NULL DEFAULT ' ', reward REAL,
    PRIMARY KEY (tenant, session_id)
);
CREATE INDEX IF NOT EXISTS sessions_recent ON sessions (last_at DESC, session_id);
CREATE INDEX IF NOT EXISTS sessions_tenant_recent ON sessions (tenant, last_at DESC, session_id);
CREATE TABLE IF NOT EXISTS turns (
    turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, parent_turn_id TEXT,
    predecessor_turn_id TEXT, fallback_reason TEXT, state TEXT NOT NULL, end_reason TEXT, detail TEXT,
    started_at REAL NOT NULL, prompt_tokens INTEGER, reused_prompt_tokens INTEGER, output_tokens INTEGER,
    policy_version INTEGER, adapter TEXT, preview TEXT, tool_calls TEXT, request_id TEXT,
    choice_index INTEGER, seq INTEGER, continues_turn_id TEXT, cached_prompt_tokens INTEGER, asked_ids TEXT,
    signals TEXT
);
CREATE INDEX IF NOT EXISTS turns_session ON turns (tenant, session_id, started_at);
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
    turn_ids TEXT NOT NULL, tokens INTEGER NOT NULL, sampled INTEGER NOT NULL, reward REAL,
    health TEXT NOT NULL, ended_at REAL, min_version INTEGER, max_version INTEGER, adapter TEXT,
    batch_id TEXT, end_reason TEXT
);
CREATE INDEX IF NOT EXISTS trajectories_session ON trajectories (tenant, session_id);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, created_at REAL, rows INTEGER, min_version INTEGER, max_version INTEGER,
    adapter TEXT, members TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS replicas (
    replica TEXT NOT NULL, adapter TEXT NOT NULL, version INTEGER NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (replica, adapter)
);
-- Which batch took each trajectory: the streams are read apart, so a batch's manifest can be indexed
-- before its members' trajectories are, and a trajectory indexed later finds its batch here.
CREATE TABLE IF NOT EXISTS batch_members (trajectory_id TEXT PRIMARY KEY, batch_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS drops (trajectory_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL);
CREATE TABLE IF NOT EXISTS forgotten (tenant TEXT NOT NULL, session_id TEXT NOT NULL, PRIMARY KEY (tenant, session_id));
"""

_PREVIEW_CHARS = 160
_ASKED_IDS = 2048  # the last prompt ids a turn appended, kept to show what was asked before its answer


@dataclass(frozen=True, slots=True)
class SessionFilter:
    """What the sessions page asks for; ``None`` fields do not filter."""

    tenant: str | None = None  # None: every tenant (an admin's view)
    agent: str | None = None
    model: str | None = None
    adapter: str | None = None
    status: str | None = None  # "open" or "closed"
    flag: str | None = None  # a health flag (consumers.trajectory.HEALTH_FLAGS, or "aborted-turn")
    since: float | None = None
    until: float | None = None
    text: str | None = None  # a substring of the session id

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        values: list[Any] = []
        for column, value in (("tenant", self.tenant), ("agent", self.agent), ("model", self.model),
                              ("adapter", self.adapter)):  # fmt: skip
            if value is not None:
                clauses.append(f"{column} = ?")
                values.append(value)
        if self.status == "open":
            clauses.append("closed IS NULL")
        elif self.status == "closed":
            clauses.append("closed IS NOT NULL")
        if self.flag:
            clauses.append("health LIKE ?")
            values.append(f"% {_like(self.flag)} %")
        if self.since is not None:
            clauses.append("last_at >= ?")
            values.append(self.since)
        if self.until is not None:
            clauses.append("last_at < ?")
            values.append(self.until)
        if self.text:
            clauses.append("session_id LIKE ? ESCAPE '\\'")
            values.append(f"%{_like(self.text)}%")
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", values


def _like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


@dataclass(slots=True)
class _Pending:
    """Writes gathered from one read of the streams, applied in one transaction."""

    rows: list[tuple[str, Any]] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)


class ConsoleIndex:
    """The SQLite file (``path``; ``None``: in memory) and every read and write of it.

    One connection, guarded by a lock: writes come from the feed in batches (one transaction per
    batch), reads from the pages; each is a few milliseconds, so callers run them in a thread.
    """

    def __init__(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._lock = threading.Lock()
        self._forgotten = {(r["tenant"], r["session_id"]) for r in self._db.execute("SELECT * FROM forgotten")}

    def _migrate(self) -> None:
        """Columns added since an index file was made (the index is a projection: nothing else changes)."""
        added = (("turns", "continues_turn_id", "TEXT"), ("turns", "cached_prompt_tokens", "INTEGER"),
                 ("trajectories", "end_reason", "TEXT"), ("turns", "asked_ids", "TEXT"),
                 ("turns", "signals", "TEXT"))  # fmt: skip
        for table, column, kind in added:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        # An index made before batch_members: its batches' members, from their manifests.
        if self._db.execute("SELECT 1 FROM batch_members LIMIT 1").fetchone() is None:
            with self._db:
                for row in self._db.execute("SELECT batch_id, members FROM batches").fetchall():
                    self._db.executemany(
                        "INSERT INTO batch_members VALUES (?, ?) ON CONFLICT DO NOTHING",
                        [(m, row["batch_id"]) for m in orjson.loads(row["members"])],
                    )
                self._db.execute(
                    "UPDATE trajectories SET batch_id = (SELECT batch_id FROM batch_members m "
                    "WHERE m.trajectory_id = trajectories.trajectory_id) WHERE batch_id IS NULL"
                )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- positions -------------------------------------------------------------------------------

    def position(self, stream: str) -> int:
        """The last sequence of ``stream`` already in the index (0: none)."""
        with self._lock:
            row = self._db.execute("SELECT seq FROM position WHERE stream = ?", (stream,)).fetchone()
        return int(row["seq"]) if row else 0

    # -- writes ----------------------------------------------------------------------------------

    def apply(self, stream: str, items: Sequence[tuple[int, str, Any]]) -> None:
        """Index ``(sequence, kind, value)`` items read from ``stream``, and remember how far it got.

        ``kind`` is ``event`` (a :class:`~pipeline.events.Event`), ``trajectory`` (its decoded
        JSON dict) or ``batch`` (a manifest's JSON dict). Applying an item twice changes nothing.
        """
        if not items:
            return
        with self._lock, self._db:
            for seq, kind, value in items:
                if kind == "event":
                    self._event(seq, value)
                elif kind == "trajectory":
                    self._trajectory(seq, value)
                elif kind == "batch":
                    self._batch(value)
                elif kind == "drop":
                    self._db.execute(
                        "INSERT INTO drops VALUES (?, ?, ?) ON CONFLICT DO UPDATE SET reason = excluded.reason, "
                        "at = excluded.at",
                        (value["trajectory_id"], value["reason"], value.get("at")),
                    )  # "skip": a message not indexed, only counted as read
            self._db.execute(
                "INSERT INTO position VALUES (?, ?) ON CONFLICT (stream) DO UPDATE SET seq = max(seq, excluded.seq)",
                (stream, max(seq for seq, _, _ in items)),
            )

    def _known(self, tenant: str, session_id: str | None) -> bool:
        return session_id is not None and (tenant, session_id) not in self._forgotten

    def _touch(self, event: Event) -> None:
        self._db.execute(
            "INSERT INTO sessions (tenant, session_id, model, last_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO UPDATE SET last_at = max(last_at, excluded.last_at)",
            (event.tenant, event.session_id, event.model, event.time),
        )

    def _event(self, seq: int, event: Event) -> None:
        if isinstance(event, PolicyApplied):
            self._db.execute(
                "INSERT INTO replicas VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE SET version = excluded.version, "
                "time = excluded.time WHERE excluded.time >= time",
                (event.replica, event.adapter or "", event.policy_version, event.time),
            )
            return
        if not self._known(event.tenant, event.session_id):
            return
        self._touch(event)
        key = (event.tenant, event.session_id)
        if isinstance(event, SessionOpened):
            self._db.execute(
                "UPDATE sessions SET agent = ?, metadata = ?, opened_at = ?, model = ? "
                "WHERE tenant = ? AND session_id = ?",
                (event.agent, orjson.dumps(event.metadata).decode(), event.time, event.model, *key),
            )
        elif isinstance(event, SessionClosed):
            self._db.execute("UPDATE sessions SET closed = ? WHERE tenant = ? AND session_id = ?", (event.reason, *key))
        elif isinstance(event, TurnStarted):
            self._db.execute(
                "INSERT INTO turns (turn_id, tenant, session_id, parent_turn_id, state, started_at, prompt_tokens, "
                "reused_prompt_tokens, policy_version, request_id, choice_index) "
                "VALUES (?, ?, ?, ?, 'live', ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (event.turn_id, *key, event.parent_turn_id, event.time, event.prompt_tokens,
                 event.reused_prompt_tokens, event.policy_version, event.request_id, event.choice_index),
            )  # fmt: skip
            self._recount(key)
        elif isinstance(event, TurnRecord):
            self._turn(seq, event)
            self._recount(key)
        elif isinstance(event, FeedbackRecorded) and event.turn_id is None:
            self._db.execute("UPDATE sessions SET reward = ? WHERE tenant = ? AND session_id = ?", (event.score, *key))

    def _turn(self, seq: int, event: TurnRecord) -> None:
        end: str
        if isinstance(event, TurnCompleted):
            state, end, detail = "completed", event.finish_reason, None
        else:
            assert isinstance(event, TurnAborted)
            state, end, detail = "aborted", event.reason, event.detail
        preview = event.content[:_PREVIEW_CHARS]
        calls = orjson.dumps([c.name for c in event.tool_calls]).decode() if event.tool_calls else None
        self._db.execute(
            "INSERT INTO turns (turn_id, tenant, session_id, parent_turn_id, predecessor_turn_id, fallback_reason, "
            "state, end_reason, detail, started_at, prompt_tokens, reused_prompt_tokens, output_tokens, "
            "policy_version, adapter, preview, tool_calls, request_id, choice_index, seq, continues_turn_id, "
            f"cached_prompt_tokens, asked_ids) VALUES ({', '.join('?' * 23)}) ON CONFLICT (turn_id) DO UPDATE SET "
            "predecessor_turn_id = excluded.predecessor_turn_id, fallback_reason = excluded.fallback_reason, "
            "state = excluded.state, end_reason = excluded.end_reason, detail = excluded.detail, "
            "started_at = excluded.started_at, "
            "prompt_tokens = excluded.prompt_tokens, output_tokens = excluded.output_tokens, "
            "adapter = excluded.adapter, preview = excluded.preview, tool_calls = excluded.tool_calls, "
            "seq = excluded.seq, continues_turn_id = excluded.continues_turn_id, "
            "cached_prompt_tokens = excluded.cached_prompt_tokens, asked_ids = excluded.asked_ids",
            (event.turn_id, event.tenant, event.session_id, event.parent_turn_id, event.predecessor_turn_id,
             event.fallback_reason, state, end, detail, event.started_at, event.usage.prompt_tokens,
             event.reused_prompt_tokens, len(event.output_ids), event.policy_version, event.adapter, preview,
             calls, event.request_id, event.choice_index, seq, event.continues_turn_id,
             event.cached_prompt_tokens, orjson.dumps(event.prompt_ids[-_ASKED_IDS:]).decode()),
        )  # fmt: skip
        for said in event.signals:  # what this turn's request said about an earlier turn: on that turn
            self._db.execute(
                "UPDATE turns SET signals = trim(coalesce(signals, '') || ' ' || ?) WHERE turn_id = ? AND "
                "instr(' ' || coalesce(signals, '') || ' ', ' ' || ? || ' ') = 0",
                (said.signal, said.turn_id, said.signal),
            )
        if event.adapter is not None:
            self._db.execute(
                "UPDATE sessions SET adapter = ? WHERE tenant = ? AND session_id = ?",
                (event.adapter, event.tenant, event.session_id),
            )

    def _recount(self, key: tuple[str, str | None]) -> None:
        self._db.execute(
            "UPDATE sessions SET turns = (SELECT count(*) FROM turns t WHERE t.tenant = sessions.tenant AND "
            "t.session_id = sessions.session_id AND t.state != 'live'), live = (SELECT count(*) FROM turns t "
            "WHERE t.tenant = sessions.tenant AND t.session_id = sessions.session_id AND t.state = 'live') "
            "WHERE tenant = ? AND session_id = ?",
            key,
        )
        self._rehealth(key)

    def _rehealth(self, key: tuple[str, str | None]) -> None:
        flags: set[str] = set()
        for row in self._db.execute("SELECT health FROM trajectories WHERE tenant = ? AND session_id = ?", key):
            flags.update(row["health"].split())
        aborted = self._db.execute(
            "SELECT 1 FROM turns WHERE tenant = ? AND session_id = ? AND state = 'aborted' LIMIT 1", key
        ).fetchone()
        if aborted:
            flags.add("aborted-turn")
        health = " " + " ".join(sorted(flags)) + " " if flags else " "
        self._db.execute("UPDATE sessions SET health = ? WHERE tenant = ? AND session_id = ?", (health, *key))

    def _trajectory(self, seq: int, data: dict[str, Any]) -> None:
        tenant, session_id = data["tenant"], data["session_id"]
        if not self._known(tenant, session_id):
            return
        sampled = sum(data["loss_mask"])
        self._db.execute(
            "INSERT INTO trajectories (trajectory_id, tenant, session_id, seq, turn_ids, tokens, sampled, reward, "
            "health, ended_at, min_version, max_version, adapter, end_reason, batch_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
            "(SELECT batch_id FROM batch_members WHERE trajectory_id = ?1)) "
            "ON CONFLICT (trajectory_id) DO UPDATE SET seq = excluded.seq, reward = excluded.reward, "
            "health = excluded.health, batch_id = coalesce(batch_id, excluded.batch_id)",
            (data["trajectory_id"], tenant, session_id, seq,
             orjson.dumps([t["turn_id"] for t in data["turns"]]).decode(), len(data["token_ids"]), sampled,
             data.get("reward"), " ".join(data.get("health") or []), data.get("ended_at"),
             data.get("min_policy_version"), data.get("max_policy_version"), data.get("adapter"),
             data.get("end_reason")),
        )  # fmt: skip
        self._db.execute(
            "INSERT INTO sessions (tenant, session_id, model, last_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (tenant, session_id, data.get("model"), data.get("ended_at") or 0.0),
        )
        self._rehealth((tenant, session_id))

    def _batch(self, data: dict[str, Any]) -> None:
        members = list(data.get("trajectory_ids") or [])
        self._db.executemany(
            "INSERT INTO batch_members VALUES (?, ?) ON CONFLICT DO NOTHING", [(m, data["batch_id"]) for m in members]
        )
        self._db.execute(
            "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (data["batch_id"], data.get("created_at"), len(members), data.get("min_policy_version"),
             data.get("max_policy_version"), data.get("adapter"), orjson.dumps(members).decode()),
        )  # fmt: skip
        self._db.executemany(
            "UPDATE trajectories SET batch_id = ? WHERE trajectory_id = ?", [(data["batch_id"], m) for m in members]
        )

    def forget(self, tenant: str, session_id: str) -> None:
        """Remove a session from the index, and keep it out (its tombstone was seen, or the console forgot it)."""
        with self._lock, self._db:
            self._forgotten.add((tenant, session_id))
            self._db.execute("INSERT INTO forgotten VALUES (?, ?) ON CONFLICT DO NOTHING", (tenant, session_id))
            for table in ("sessions", "turns", "trajectories"):
                self._db.execute(f"DELETE FROM {table} WHERE tenant = ? AND session_id = ?", (tenant, session_id))

    def all_sessions(self) -> list[tuple[str, str]]:
        """Every (tenant, session id) indexed (the tombstone sweep's list)."""
        with self._lock:
            return [(r[0], r[1]) for r in self._db.execute("SELECT tenant, session_id FROM sessions")]

    def insert_sessions(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Bulk rows for the scale benchmark (``benchmarks/console_scale.py``): (tenant, session_id, model,
        agent, opened_at, last_at, turns, health)."""
        with self._lock, self._db:
            self._db.executemany(
                "INSERT INTO sessions (tenant, session_id, model, agent, opened_at, last_at, turns, health) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )

    # -- reads -----------------------------------------------------------------------------------

    def sessions(self, flt: SessionFilter, *, before: tuple[float, str] | None, limit: int) -> list[dict[str, Any]]:
        """One page of sessions, newest activity first; ``before``: the last row of the previous page."""
        where, values = flt.where()
        if before is not None:
            where += (" AND " if where else " WHERE ") + "(last_at < ? OR (last_at = ? AND session_id < ?))"
            values += [before[0], before[0], before[1]]
        query = f"SELECT * FROM sessions{where} ORDER BY last_at DESC, session_id DESC LIMIT ?"
        with self._lock:
            return [_session_row(r) for r in self._db.execute(query, [*values, min(limit, PAGE_LIMIT)])]

    def count(self, flt: SessionFilter) -> int:
        where, values = flt.where()
        with self._lock:
            return int(self._db.execute(f"SELECT count(*) FROM sessions{where}", values).fetchone()[0])

    def facets(self, tenant: str | None) -> dict[str, list[str]]:
        """The values the filters offer (agents, models, adapters seen), per tenant."""
        where, values = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        out: dict[str, list[str]] = {}
        with self._lock:
            for column in ("agent", "model", "adapter"):
                rows = self._db.execute(
                    f"SELECT DISTINCT {column} FROM sessions {where} {'AND' if where else 'WHERE'} "
                    f"{column} IS NOT NULL LIMIT 50",
                    values,
                )
                out[column] = sorted(r[0] for r in rows)
        return out

    def session(self, tenant: str | None, session_id: str) -> dict[str, Any] | None:
        """A session with its first turns (``turns_limit``) and its trajectories, or ``None``."""
        where = "session_id = ?" + (" AND tenant = ?" if tenant is not None else "")
        values = [session_id, *([tenant] if tenant is not None else [])]
        with self._lock:
            row = self._db.execute(f"SELECT * FROM sessions WHERE {where} ORDER BY last_at DESC", values).fetchone()
            if row is None:
                return None
            key = (row["tenant"], row["session_id"])
            trajectories = [dict(r) for r in self._db.execute(
                "SELECT t.trajectory_id, seq, turn_ids, tokens, sampled, reward, health, ended_at, min_version, "
                "max_version, adapter, batch_id, d.reason AS dropped FROM trajectories t LEFT JOIN drops d "
                "ON d.trajectory_id = t.trajectory_id WHERE tenant = ? AND session_id = ? ORDER BY ended_at",
                key,
            )]  # fmt: skip
        for t in trajectories:
            t["turn_ids"] = orjson.loads(t["turn_ids"])
            t["health"] = t["health"].split()
        return {**_session_row(row), "trajectories": trajectories}

    def tenants_of(self, session_id: str) -> list[str]:
        """The tenants that have a session named ``session_id`` (a name is its tenant's: several may)."""
        with self._lock:
            rows = self._db.execute("SELECT tenant FROM sessions WHERE session_id = ? ORDER BY tenant", [session_id])
            return [r["tenant"] for r in rows]

    def turns(self, tenant: str, session_id: str, *, offset: int, limit: int) -> list[dict[str, Any]]:
        """A page of a session's turns in the order they started."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM turns WHERE tenant = ? AND session_id = ? ORDER BY started_at, turn_id LIMIT ? OFFSET ?",
                (tenant, session_id, min(limit, PAGE_LIMIT * 5), offset),
            ).fetchall()
            continued = {
                r[0]
                for r in self._db.execute(
                    "SELECT parent_turn_id FROM turns WHERE tenant = ? AND session_id = ? UNION "
                    "SELECT predecessor_turn_id FROM turns WHERE tenant = ? AND session_id = ? UNION "
                    "SELECT continues_turn_id FROM turns WHERE tenant = ? AND session_id = ?",
                    (tenant, session_id) * 3,
                )
            }
        turns = [dict(r) for r in rows]
        for t in turns:
            t["tool_calls"] = orjson.loads(t["tool_calls"]) if t["tool_calls"] else []
            t["asked_ids"] = orjson.loads(t["asked_ids"]) if t["asked_ids"] else []
            names = set((t["signals"] or "").split())
            names |= {"accepted"} if t["turn_id"] in continued else set()
            names |= {"abandoned"} if t["end_reason"] == "client_disconnected" else set()
            t["signals"] = [name for name in SIGNALS if name in names]  # consumers.signals' order
        return turns

    def turn(self, turn_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
        return dict(row) if row else None

    def trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM trajectories WHERE trajectory_id = ?", (trajectory_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["turn_ids"], out["health"] = orjson.loads(out["turn_ids"]), out["health"].split()
        return out

    def counts(self) -> dict[str, Any]:
        """What ``/metrics`` reports: sessions, trajectories, and trajectories per health flag and end reason."""
        with self._lock:
            sessions = int(self._db.execute("SELECT count(*) FROM sessions").fetchone()[0])
            total = int(self._db.execute("SELECT count(*) FROM trajectories").fetchone()[0])
            flags: dict[str, int] = {}
            for (health,) in self._db.execute("SELECT health FROM trajectories WHERE health != ''"):
                for flag in health.split():
                    flags[flag] = flags.get(flag, 0) + 1
            ends = dict(
                self._db.execute("SELECT coalesce(end_reason, 'unknown'), count(*) FROM trajectories GROUP BY 1")
            )
            batched = int(
                self._db.execute("SELECT count(*) FROM trajectories WHERE batch_id IS NOT NULL").fetchone()[0]
            )
            drops = dict(self._db.execute("SELECT reason, count(*) FROM drops GROUP BY 1"))
        return {"sessions": sessions, "trajectories": total, "health": flags, "end_reasons": ends,
                "batched": batched, "dropped": drops}  # fmt: skip

    def loop(self, tenant: str | None) -> dict[str, Any]:
        """The training loop at a glance: each replica's policy version, the batches and their
        staleness, and the rewards of the trajectories over time."""
        where, values = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        with self._lock:
            replicas = [dict(r) for r in self._db.execute("SELECT * FROM replicas ORDER BY replica, adapter")]
            batches = [dict(r) for r in self._db.execute(
                "SELECT batch_id, created_at, rows, min_version, max_version, adapter FROM batches "
                "ORDER BY created_at DESC LIMIT 50")]  # fmt: skip
            rewards = [dict(r) for r in self._db.execute(
                f"SELECT ended_at, reward FROM trajectories {where} {'AND' if where else 'WHERE'} reward IS NOT NULL "
                "ORDER BY ended_at DESC LIMIT 2000", values)]  # fmt: skip
        # The newest version anything served: a replica's (policy.applied), else a batch's newest token's.
        newest = max((r["version"] for r in replicas), default=None)
        if newest is None:
            newest = max((b["max_version"] for b in batches if b["max_version"] is not None), default=None)
        for batch in batches:
            batch["lag"] = None if newest is None or batch["min_version"] is None else newest - batch["min_version"]
        if tenant is not None:
            batches = []  # batches mix tenants: only an admin sees them whole
        return {"replicas": replicas, "batches": batches, "rewards": rewards[::-1], "newest_version": newest}


def _session_row(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    out["health"] = out["health"].split()
    out["metadata"] = orjson.loads(out["metadata"]) if out.get("metadata") else {}
    return out
