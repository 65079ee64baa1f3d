"""A batcher in a process of its own, for the kill -9 tests: ``python -m tests.support.batcher_process SPEC``.

``SPEC`` is JSON: the :class:`~consumers.batcher.BatcherConfig` fields (``names`` as a dict of
:class:`~consumers.streams.ConsumerStreams` fields), plus two test-only keys:

* ``die_at``: ``"commit"``, ``"manifest"`` or ``"published"``: the process SIGKILLs itself right
  after that step of the first batch it writes (the record committed; the manifest published;
  the record marked published, before the acks), so each window of the exactly-once argument
  is hit for certain, not only by luck;
* ``step_delay_s``: a pause after each of those steps, widening the windows that a kill from
  outside at a random moment can land in.

It prints ``ready`` once the batcher consumes. The hooks wrap the private steps of the batcher's
writer (:mod:`consumers._batch_writer`): a test instrument, not an API.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from functools import wraps
from typing import Any

import anyio

import consumers._batch_writer as writer_module
import consumers.verl_batch  # noqa: F401  (imported now, so startup time does not vary with the first message)
from consumers._batch_writer import BatchWriter
from consumers.batcher import Batcher, BatcherConfig
from consumers.streams import ConsumerStreams


def _instrument(die_at: str | None, delay: float) -> None:
    def after(step: str, original: Any) -> Any:
        @wraps(original)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await original(*args, **kwargs)
            if step == "manifest" and ".batches." not in str(args[2]):
                return result  # publish_durable of something other than a manifest
            if die_at == step:
                os.kill(os.getpid(), signal.SIGKILL)
            if delay:
                await anyio.sleep(delay)
            return result

        return wrapper

    BatchWriter.commit = after("commit", BatchWriter.commit)  # type: ignore[method-assign]
    BatchWriter.publish = after("published", BatchWriter.publish)  # type: ignore[method-assign]
    writer_module.publish_durable = after("manifest", writer_module.publish_durable)  # type: ignore[attr-defined]


async def _main(config: BatcherConfig) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(Batcher(config).run)
        print("ready", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(message)s")
    spec: dict[str, Any] = json.loads(sys.argv[1])
    _instrument(spec.pop("die_at", None), float(spec.pop("step_delay_s", 0.0)))
    names = ConsumerStreams(**spec.pop("names"))
    servers = tuple(spec.pop("servers"))
    anyio.run(_main, BatcherConfig.of(servers=servers, names=names, **spec))


if __name__ == "__main__":
    main()
