"""Asks for help between queue shards (``DISPATCH_SHARDS``): a front whose miss waits behind
its own shard's busy engines, or none, pushes that shard's number on another shard's help
bell, each other shard in turn, for an idle engine there to take from it
(``app/engine_side/helping.py``). One command on that shard's master (two once its bell holds
``HELP_BELL_MAX`` asks: an ask is heard once, by one engine, so more would only wake idle
engines for nothing). An ask lost to a Redis error costs only the help: the miss waits for
its own shard's engines, and its lane's fallback check asks again while tickets wait
untaken or a holder is silent (``watch.py``).
"""

from __future__ import annotations

import itertools
from typing import Any

from app.cache.keys import QueueKeys
from app.cache.store import RedisStore

HELP_BELL_MAX = 8


class HelpAsks:
    """Asks another of ``shards`` for help, each in turn (``ask(behind)``); with one shard,
    none (asking off is this object, not a test at each call site)."""

    def __init__(self, store: RedisStore, shards: tuple[QueueKeys, ...]) -> None:
        self._store = store
        self._shards = shards
        self._turns = itertools.count()  # next() is atomic: the front's threads share it

    def queued(self, names: QueueKeys, answer: list[Any]) -> None:
        """A ticket just queued in ``names`` (``queue_submit.lua``'s answer: id, waiting,
        engines, rings, busy): help is asked when it waits behind busy engines: more tickets
        waiting in its lane than engines not busy with the lane (none live included), or
        rings on the idle engines' bell that no engine heard (every engine busy)."""
        waiting, engines = int(answer[1]), int(answer[2])
        rings, busy = (int(answer[3]), int(answer[4])) if len(answer) > 4 else (0, 0)
        if len(self._shards) > 1 and (waiting > engines - busy or rings > 1):
            self(names)

    def still_waiting(self, names: QueueKeys, silent: bool) -> None:
        """A lane's fallback check found tickets of ``names`` waiting untaken, or held by a
        ``silent`` holder: asked again, the helper told to reclaim there first when a holder
        was silent (a helper that died, where the shard may have no engine of its own to
        reclaim it)."""
        self(names, reclaim=silent)

    def __call__(self, behind: QueueKeys, reclaim: bool = False) -> None:
        """``behind``'s engines cannot take its new ticket now: the next other shard is asked."""
        others = [names for names in self._shards if names != behind]
        if not others:
            return
        helper = others[next(self._turns) % len(others)]
        shard = f"{self._shards.index(behind)}{'r' if reclaim else ''}"

        def ask(client: Any) -> None:
            if client.lpush(helper.help_bell, shard) > HELP_BELL_MAX:
                client.ltrim(helper.help_bell, 0, HELP_BELL_MAX - 1)

        self._store.run("dispatch", ask)
