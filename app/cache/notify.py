"""Cross-process notifications over Redis pub/sub: "computation finished" and "purged".

One listener thread per process holds one pattern subscription (``{prefix}:done:*``) and
wakes the local threads waiting on a key, so a waiter blocks on an Event instead of
polling Redis; a message on ``{prefix}:purge`` drops this process's L1; one on
``{prefix}:queue-lost`` (an engine found the queue's keys lost) makes every waiter check
its ticket at once, as after a reconnection. If Redis is
unreachable the listener retries in the background; once it is back every waiter is woken
to look (a message sent meanwhile is lost), and waiters check on their ticket now and then
(``app.queue.requester.TicketQueue``), so a lost message costs a check, and a Redis error
sends them to their own engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from app.cache.keys import KeySpace
from app.cache.store import RedisStore

log = logging.getLogger(__name__)


class Notifier:
    def __init__(
        self, store: RedisStore, keys: KeySpace, on_purge: Callable[[], None] = lambda: None
    ) -> None:
        self._store = store
        self._pattern = keys.done_pattern()
        self._purge_channel = keys.purge_channel()
        self._lost_channel = keys.queue_lost_channel()
        self._on_purge = on_purge
        self._lock = threading.Lock()
        self._waiters: dict[str, list[Wakeup]] = {}
        self._first_try = threading.Event()  # the listener's first subscribe ended, either way
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Listen from now on (whether this call started the listener). A process starts it
        when it builds its cache: one that only ever serves hits must still hear a purge and
        drop its L1."""
        with self._lock:
            if self._thread is not None:
                return False
            self._thread = threading.Thread(target=self._run, name="ocr-notify", daemon=True)
            self._thread.start()
        _live.add(self)
        return True

    def stop(self) -> None:
        """Stop listening: the listener ends within a second (its read timeout). For a
        process done with its cache: a test's app, whose Redis server stops with the test,
        would otherwise retry it for as long as the process runs (hundreds of them, retrying
        in step, took a test process's GIL)."""
        self._stopping.set()
        _live.discard(self)

    def _ensure_started(self) -> None:
        # Until the listener's first try to subscribe ended, a waiter gives it a moment, so
        # no notification is missed; after it, nobody waits (while Redis is down the listener
        # is not subscribed, and each miss must not pay for that).
        self.start()
        self._first_try.wait(0.5)

    def register(self, channel: str) -> Wakeup:
        """Register before re-checking the cache; then ``wait`` on the returned event."""
        self._ensure_started()
        event = Wakeup()
        with self._lock:
            self._waiters.setdefault(channel, []).append(event)
        return event

    def unregister(self, channel: str, event: threading.Event) -> None:
        with self._lock:
            events = self._waiters.get(channel, [])
            if event in events:
                events.remove(event)
            if not events:
                self._waiters.pop(channel, None)

    def _run(self) -> None:
        backoff, before = 0.1, False
        while not self._stopping.is_set():  # a daemon thread: it lives until stop()
            client: Any = None
            try:
                client = self._store.pubsub_client()
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe(self._pattern)
                pubsub.subscribe(self._purge_channel, self._lost_channel)
                self._first_try.set()
                if before:  # messages sent while it was away are lost: every waiter checks
                    self._wake_all()
                before, backoff = True, 0.1
                while not self._stopping.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message.get("type") == "pmessage":
                        self._wake(message["channel"], message.get("data"))
                    elif message and message.get("type") == "message":
                        if self._is_lost(message.get("channel")):
                            self._wake_all()  # the queue's keys were lost: every waiter checks
                        else:
                            self._on_purge()
            except Exception as exc:  # any Redis/socket failure: resubscribe later
                self._first_try.set()
                log.debug("notification listener: %s; retrying", exc.__class__.__name__)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                if client is not None:
                    try:
                        client.close()
                    except Exception:  # noqa: S110 - closing a broken client
                        pass

    def _is_lost(self, channel: bytes | str) -> bool:
        return _text(channel) == self._lost_channel

    def _wake(self, channel: bytes | str, data: object = None) -> None:
        name = _text(channel)
        message = data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")
        with self._lock:
            events = list(self._waiters.get(name, []))
        for event in events:
            event.messages.append(message)
            event.set()

    def _wake_all(self) -> None:
        with self._lock:
            events = [event for waiting in self._waiters.values() for event in waiting]
        for event in events:
            event.messages.append("")  # no notice: look now
            event.set()


class Wakeup(threading.Event):
    """A waiter's event, with the messages that woke it (the queue's feeders say
    ``ok:<ticket>``, ``error:<ticket>:...``, ``lost:<ticket>`` or ``gone:<ticket>`` there;
    "" after the listener reconnected)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []


def _text(channel: bytes | str) -> str:
    """A channel's name as redis-py hands it (bytes, or str when it decodes responses)."""
    return channel.decode() if isinstance(channel, bytes) else channel


# Every listening notifier, so tests can stop those their test started (as feeders._live).
_live: set[Notifier] = set()
