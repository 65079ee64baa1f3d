"""A pushed response's writer (``stream_gateway/http/_sse.py``): a write steps the server's ``send``
by hand and returns; a send that waits (the client is behind) is finished in a task, later writes
wait in order behind it, and the producer is paused until they are out.

The ``send`` here is an ASGI send shaped as uvicorn's (0.55, ``httptools_impl``): it writes at once
unless writing is paused, then it waits for the transport to drain first.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stream_gateway.http._sse import TokenStreamResponse, _Writer

pytestmark = pytest.mark.anyio


class _Server:
    """An ASGI ``send`` with uvicorn's flow control: ``paused`` makes a send wait for ``drain``."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    def pause(self) -> None:
        self.paused = True
        self._writable.clear()

    def drain(self) -> None:
        self.paused = False
        self._writable.set()

    async def send(self, message: dict[str, Any]) -> None:
        if self.paused:
            await self._writable.wait()
        self.written.append(message["body"])


def _writer(server: _Server) -> tuple[_Writer, list[str]]:
    async def push(_: Any) -> None:
        return None

    response = TokenStreamResponse(None, push=push)
    writer = _Writer(server.send, response)  # type: ignore[arg-type]
    flow: list[str] = []
    writer.when_behind(lambda: flow.append("pause"), lambda: flow.append("resume"))
    return writer, flow


async def test_a_write_goes_out_before_it_returns() -> None:
    server = _Server()
    writer, flow = _writer(server)
    writer.write(b"a")
    writer.write(b"b")
    assert server.written == [b"a", b"b"]
    assert not writer.behind and flow == []
    await writer.drained()


async def test_a_write_that_waits_holds_the_rest_in_order_and_pauses_the_producer() -> None:
    server = _Server()
    writer, flow = _writer(server)
    writer.write(b"1")
    server.pause()
    writer.write(b"2")  # the client is behind: this send waits
    assert writer.behind and flow == ["pause"]
    writer.write(b"3")
    writer.write(b"4")
    await asyncio.sleep(0.01)
    assert server.written == [b"1"]  # nothing overtakes the waiting send
    server.drain()
    await writer.drained()
    assert server.written == [b"1", b"2", b"34"]  # what waited goes out together, in order
    assert not writer.behind and flow == ["pause", "resume"]
    writer.write(b"5")
    assert server.written[-1] == b"5"


async def test_closing_a_writer_cancels_a_send_that_waits() -> None:
    server = _Server()
    writer, flow = _writer(server)
    server.pause()
    writer.write(b"x")
    assert writer.behind
    writer.close()
    await asyncio.sleep(0.01)
    server.drain()
    await asyncio.sleep(0.01)
    assert server.written == []  # the waiting send was cancelled, not finished
    assert flow == ["pause"]


async def test_a_send_that_fails_while_waiting_fails_the_drain_and_later_writes() -> None:
    async def broken(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the transport broke")

    async def push(_: Any) -> None:
        return None

    writer = _Writer(broken, TokenStreamResponse(None, push=push))  # type: ignore[arg-type]
    writer.write(b"x")
    with pytest.raises(RuntimeError, match="the transport broke"):
        await writer.drained()
    with pytest.raises(RuntimeError, match="the transport broke"):
        writer.write(b"y")
