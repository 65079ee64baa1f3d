"""What an async-generator layer costs per item on the relay's path, against a task's wake-up per item.

Run (from the repository root)::

    .venv/bin/python benchmarks/generator_layers.py

Each item is made the way the remote engine's reads are: the innermost generator awaits a future
that a loop callback resolves (``call_soon``, as a socket's ``data_received`` wakes the reader), so
every item suspends the whole chain and resumes it through each layer. Around it, 0 to 7 plain
``async for ... yield`` layers (the relay's path had seven before issue 59: ``sse_batches`` up to
``_stream_response``). Printed: process CPU microseconds per item, the median of ``--repeats`` runs,
on uvloop as the gateway runs. The answer it gave (docs/performance.md, "The floor"): the wake-up
costs about 2 us an item, each layer about 0.13 us, so the layers were not what keeps the front
from the bare relay.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator

import uvloop


async def _source(items: int) -> AsyncIterator[int]:
    loop = asyncio.get_running_loop()
    for i in range(items):
        future: asyncio.Future[int] = loop.create_future()
        loop.call_soon(future.set_result, i)
        yield await future


async def _layer(inner: AsyncIterator[int]) -> AsyncIterator[int]:
    async for item in inner:
        yield item


async def _per_item_us(depth: int, items: int) -> float:
    chain = _source(items)
    for _ in range(depth):
        chain = _layer(chain)
    started = time.process_time()
    async for _ in chain:
        pass
    return (time.process_time() - started) / items * 1e6


async def _main(depths: list[int], items: int, repeats: int) -> None:
    print("| layers | CPU us per item (median) |\n|---:|---:|")
    for depth in depths:
        runs = [await _per_item_us(depth, items) for _ in range(repeats)]
        print(f"| {depth} | {statistics.median(runs):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 4, 7])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    uvloop.run(_main(args.depths, args.items, args.repeats))


if __name__ == "__main__":
    main()
