"""Where a user's data could be: every stream of a NATS server (the events, and the streams behind
every key-value bucket and object store), and files on disk (outboxes, parquet batches).

``nats_traces(url, needles)`` reads every message of every stream (subject, headers and payload)
and names each one that holds any of ``needles``; ``file_traces(root, needles)`` does the same
for every file under ``root``. A scan that finds nothing is only as good as its needles: a test
checks them against data it knows is there (another session's) before it trusts an empty scan.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import anyio

from pipeline.connection import connect


def nats_traces(url: str, needles: Iterable[bytes]) -> list[str]:
    """``stream#seq subject`` of every stored message holding one of ``needles``."""
    wanted = [n for n in needles if n]

    async def scan() -> list[str]:
        nc = await connect(url, None, max_reconnect_attempts=2, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream()
            found = []
            for info in await js.streams_info():
                name, state = info.config.name, info.state
                if not state.messages:
                    continue
                for seq in range(state.first_seq, state.last_seq + 1):
                    try:
                        msg = await js.get_msg(name, seq)
                    except Exception:  # deleted (a purge, a KV update): nothing there
                        continue
                    raw = b"".join((msg.subject.encode(), repr(msg.headers or {}).encode(), msg.data or b""))
                    if any(n in raw for n in wanted):
                        found.append(f"{name}#{seq} {msg.subject}")
            return found
        finally:
            await nc.close()

    return anyio.run(scan)


def file_traces(root: Path, needles: Iterable[bytes]) -> list[str]:
    """Every file under ``root`` holding one of ``needles``."""
    wanted = [n for n in needles if n]
    if not root.exists():
        return []
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in wanted))


def ids_text(ids: list[int]) -> bytes:
    """How a run of token ids reads in the events' JSON (``1,2,3``): a needle for them."""
    return ",".join(map(str, ids)).encode()
