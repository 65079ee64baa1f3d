"""A key-value bucket read whole (pipeline/kv.py), even when nats-py's own reading ends too early.

The race (nats-py 2.16.0's ``KeyValue.watch``): the server has sent a watch's messages, but the
client has not handled them yet when the consumer's info arrives, so nats-py decides that the bucket
is empty. A fresh-clone run hit it on a busy machine (the scores a test had just written were not
listed). Here it is made to happen every time: a real nats-server and a real client, with a small TCP
relay between them that holds JetStream's deliveries (frames whose reply subject is ``$JS.ACK...``)
back for a moment and lets everything else through at once, and that passes a request for a
consumer's info on a moment late, so that the server has sent every delivery by then.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import nats
import pytest
from anyio.abc import SocketStream
from nats.js.errors import NoKeysError

from pipeline.embedded import EmbeddedNatsServer
from pipeline.kv import current_entries, current_keys, watch_entries

pytestmark = pytest.mark.anyio

_HOLD_S = 1.0
_ASK_LATE_S = 0.25  # far longer than the server takes to send a few deliveries, even on a busy machine
_MSG = re.compile(rb"^H?MSG [^\r]* (?P<size>\d+)\r\n")  # from the server: the last field is the size
_PUB = re.compile(rb"^H?PUB [^\r]* (?P<size>\d+)\r\n")  # from the client


async def _relay_lagging_deliveries(client: SocketStream, server: SocketStream) -> None:
    """Client to server as is; server to client frame by frame, JetStream deliveries each held back
    ``_HOLD_S`` (in their order), the rest at once."""
    send, receive = anyio.create_memory_object_stream[bytes](1000)
    async with send, receive, anyio.create_task_group() as tg:

        async def upstream() -> None:  # a consumer's info asked a moment late: its deliveries all sent by then
            async for frame in _frames(client, _PUB):
                if frame.startswith((b"PUB $JS.API.CONSUMER.INFO.", b"HPUB $JS.API.CONSUMER.INFO.")):
                    await anyio.sleep(_ASK_LATE_S)
                await server.send(frame)

        async def later(frame: bytes) -> None:
            await anyio.sleep(_HOLD_S)
            await send.send(frame)

        writing = anyio.Lock()  # one writer at a time to the client's socket

        async def to_client(frame: bytes) -> None:
            async with writing:
                await client.send(frame)

        async def deliver_held() -> None:
            async for frame in receive:
                await to_client(frame)

        tg.start_soon(upstream)
        tg.start_soon(deliver_held)
        async for frame in _frames(server, _MSG):
            if _delivery(frame):
                tg.start_soon(later, frame)  # each sleeps the same time from arrival: order kept
            else:
                await to_client(frame)
        tg.cancel_scope.cancel()


async def _frames(stream: SocketStream, framed: re.Pattern[bytes]) -> AsyncIterator[bytes]:
    """The whole protocol frames read from ``stream``, one at a time."""
    buffer = b""
    async for data in stream:
        buffer += data
        while True:
            frame, buffer = _cut(buffer, framed)
            if frame is None:
                break
            yield frame


def _cut(buffer: bytes, framed: re.Pattern[bytes]) -> tuple[bytes | None, bytes]:
    """The first whole protocol frame of ``buffer`` (``framed``: the lines a payload follows), and the rest."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None, buffer
    match = framed.match(buffer)
    if match is None:  # INFO, CONNECT, SUB, PING, PONG, +OK, -ERR...: one line
        return buffer[: end + 2], buffer[end + 2 :]
    size = match.end() + int(match.group("size")) + 2
    if len(buffer) < size:
        return None, buffer
    return buffer[:size], buffer[size:]


def _delivery(frame: bytes) -> bool:
    """Whether a MSG or HMSG frame is a JetStream delivery (its reply subject ``$JS.ACK...``)."""
    match = _MSG.match(frame)
    if match is None:
        return False
    fields = frame[: match.end() - 2].split(b" ")
    # MSG subject sid [reply] size; HMSG subject sid [reply] header-size size
    return len(fields) == (6 if fields[0] == b"HMSG" else 5) and fields[3].startswith(b"$JS.ACK.")


@asynccontextmanager
async def lagging(url: str) -> AsyncIterator[str]:
    """A ``nats://`` address whose JetStream deliveries arrive ``_HOLD_S`` late."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def serve(client: SocketStream) -> None:
        async with client, await anyio.connect_tcp(host, int(port)) as server:
            await _relay_lagging_deliveries(client, server)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield f"nats://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        tg.cancel_scope.cancel()


async def test_a_bucket_is_read_whole_where_nats_pys_keys_finds_nothing(nats_server: EmbeddedNatsServer) -> None:
    async with lagging(nats_server.url) as url:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            bucket = f"whole-{secrets.token_hex(4)}"
            kv = await js.create_key_value(bucket=bucket)
            for key in ("a", "b.1", "b.2", "gone", "purged"):
                await kv.put(key, key.encode())
            await kv.delete("gone")
            await kv.purge("purged")

            with pytest.raises(NoKeysError):  # the race, every time: nats-py's None before the entries
                await kv.keys()

            assert await current_keys(kv) == ["a", "b.1", "b.2"]
            assert await current_keys(kv, "b.*") == ["b.1", "b.2"]
            entries = await current_entries(kv)
            assert {key: entry.value for key, entry in entries.items()} == {"a": b"a", "b.1": b"b.1", "b.2": b"b.2"}

            # A watch: the current contents (markers included), None once, then what is written after.
            seen: list[tuple[str, str | None] | None] = []
            with anyio.fail_after(10):
                async for entry in watch_entries(kv):
                    seen.append(None if entry is None else (entry.key, entry.operation))
                    if entry is None:
                        await kv.put("c", b"c")
                    elif entry.key == "c":
                        break
            current = [("a", None), ("b.1", None), ("b.2", None), ("gone", "DEL"), ("purged", "PURGE")]
            assert seen == [*current, None, ("c", None)]

            # Writes that never stop do not keep the read from ending (it ends at the bucket's last
            # sequence as the read began, not when the consumer has nothing left to send).
            async def keep_writing() -> None:
                for n in range(100_000):
                    await kv.put(f"w.{n}", b"w")
                    await anyio.sleep(0.005)

            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_writing)
                await anyio.sleep(0.2)
                with anyio.fail_after(20):
                    during = await current_keys(kv)
                tg.cancel_scope.cancel()
            assert {"a", "b.1", "b.2", "c", "w.0"} <= set(during)

            empty = await js.create_key_value(bucket=f"{bucket}-empty")
            assert await current_keys(empty) == []
        finally:
            await nc.close()
