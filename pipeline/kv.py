"""Reading a key-value bucket whole: every key it holds now, never a false "nothing there".

nats-py's ``KeyValue.keys()`` and the ``None`` its watchers put after a bucket's current contents
(nats-py 2.16.0, read: ``nats/js/kv.py``'s ``watch``) can come too early. Right after subscribing it
compares the server's count of what is still to send with the messages its callback has already
handled, and messages the server has sent but the client has not yet handled count in neither: on a
busy machine ``keys()`` then answers "no keys" for a bucket that has some (nats-py issue 842, its fix
still open as pull request 995). A fresh-clone run of this suite hit it: the scores a test had just
written were not listed.

Here the end of a bucket's current contents is decided by stream sequence numbers instead (an
ordered consumer that restarts after a gap keeps them). The bucket's last sequence, read once the
watch is made, is a fixed end: a message handled at or past it means everything before it has been
(deliveries come in sequence order), however many writes follow. Where the last messages were other
keys' (a watch of some keys), the consumer's own record on the server (its info) says how many
messages are left to send and the sequence of the last one sent: nothing left and that one handled
is the end too. The info is asked again each time the watch catches up with what it said.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ["current_entries", "current_keys", "watch_entries"]

_DELETED = ("DEL", "PURGE")
_LINGER_S = 10.0


async def watch_entries(
    kv: KeyValue, keys: str = ">", *, meta_only: bool = False, timeout_s: float = 10.0
) -> AsyncGenerator[KeyValue.Entry | None, None]:
    """Every current entry of ``kv`` matching ``keys`` (deleted and purged ones as their markers,
    ``operation`` "DEL" or "PURGE"), then ``None`` exactly once, when all that the bucket held at the
    start has been yielded, then each change as it is written, until the caller stops iterating.
    ``TimeoutError`` if the bucket's current contents do not arrive within ``timeout_s`` of each other."""
    # The server drops the watch's consumer this long after the watch is gone (nats-py's default,
    # 5 minutes, let one-off reads pile up consumers until the server refused new ones).
    watcher = await kv.watch(keys, meta_only=meta_only, inactive_threshold=_LINGER_S)
    try:
        # A fixed end: every message up to here is the bucket's contents at the start. Reaching it
        # ends the wait even while writes keep coming (asking the consumer alone would chase them).
        last = (await kv.status()).stream_info.state.last_seq or 0
        seen = 0  # the highest stream sequence yielded
        while seen < last:
            assert watcher._sub is not None  # set by kv.watch; nats-py has no public way to the consumer
            info = await watcher._sub.consumer_info()
            sent = info.delivered
            if info.num_pending == 0 and (sent is None or sent.consumer_seq == 0 or sent.stream_seq <= seen):
                break  # nothing more matches (the last messages were other keys')
            # up to the last message sent (no further than the end), and at least one more than now
            goal = max(min(sent.stream_seq if sent is not None else 0, last), seen + 1)
            while seen < goal:
                entry = await _next(watcher, timeout_s)
                if entry is None:  # nats-py's own marker: its timing is what this module replaces
                    continue
                seen = max(seen, entry.revision or 0)
                yield entry
        yield None
        while True:
            entry = await _next(watcher, None)
            if entry is not None:
                yield entry
    finally:
        with anyio.CancelScope(shield=True):
            await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it unannotated


async def _next(watcher: KeyValue.KeyWatcher, timeout_s: float | None) -> KeyValue.Entry | None:
    if timeout_s is None:
        return await anext(watcher)
    with anyio.fail_after(timeout_s):
        return await anext(watcher)


async def current_entries(
    kv: KeyValue, keys: str = ">", *, meta_only: bool = False, timeout_s: float = 10.0
) -> dict[str, KeyValue.Entry]:
    """The entries ``kv`` holds now under ``keys``, by key (deleted and purged keys left out); an
    empty bucket is an empty dict, never an error."""
    found: dict[str, KeyValue.Entry] = {}
    entries = watch_entries(kv, keys, meta_only=meta_only, timeout_s=timeout_s)
    try:
        async for entry in entries:
            if entry is None:
                break
            if entry.operation in _DELETED:
                found.pop(entry.key, None)
            else:
                found[entry.key] = entry
    finally:
        await entries.aclose()
    return found


async def current_keys(kv: KeyValue, keys: str = ">", *, timeout_s: float = 10.0) -> list[str]:
    """The keys ``kv`` holds now under ``keys``, sorted (what ``KeyValue.keys()`` is meant to answer)."""
    return sorted(await current_entries(kv, keys, meta_only=True, timeout_s=timeout_s))
