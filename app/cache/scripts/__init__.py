"""Every Lua script of the service, in one place: each lives in a ``.lua`` file beside this
module (its header says what it does atomically, its ``KEYS`` and ``ARGV``, and every other
key it names), is read once at import, and is run by name: ``QUEUE_TAKE(client, keys,
args)``. This is the only module that sends ``EVALSHA``/``SCRIPT LOAD``, for every process:
fronts (the tiers, the requester, purges, quotas) and engine processes (the feeders' steps).

A script is sent by its SHA-1 (``EVALSHA``); a server that does not know it yet (a fresh
node, a restart, ``SCRIPT FLUSH``, a failover) answers ``NOSCRIPT``, and the script is then
loaded (``SCRIPT LOAD``: on a Redis Cluster, on every primary) and sent again: redis-py's
``register_script`` does the same, but binds each script to one client; these work with any
client the store hands out (``redis.Redis``, a Sentinel's master, ``RedisCluster``).

Every script touches only the keys in its ``KEYS``, or keys it builds from a ``KEYS``
element under the same hash tag (the queue's lane streams: its stream prefix is passed in
``KEYS``), so one script runs on one node of a Redis Cluster, unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import NoScriptError

HERE = Path(__file__).resolve().parent


class Script:
    """One Lua script, run by its SHA-1 on whichever client is given."""

    def __init__(self, name: str, text: str | None = None) -> None:
        self.name = name
        self.text = text if text is not None else (HERE / f"{name}.lua").read_text("utf-8")
        self.sha = hashlib.sha1(self.text.encode("utf-8"), usedforsecurity=False).hexdigest()

    @classmethod
    def chain(cls, first: Script, second: Script) -> Script:
        """One script that runs ``first`` then ``second`` atomically and answers the
        second's answer: a round trip and a script call fewer than the two. Called with the
        first's keys then the second's, and the arguments ``len(first keys)``,
        ``len(first args)``, the first's args, the second's (``run_chain``). Each body runs
        as a function whose parameters ``KEYS`` and ``ARGV`` hide the globals, unchanged."""
        text = (
            f"local function first(KEYS, ARGV)\n{first.text}\nend\n"
            f"local function second(KEYS, ARGV)\n{second.text}\nend\n"
            "local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])\n"
            "first({unpack(KEYS, 1, nk)}, {unpack(ARGV, 3, na + 2)})\n"
            "return second({unpack(KEYS, nk + 1)}, {unpack(ARGV, na + 3)})\n"
        )
        return cls(f"{first.name}+{second.name}", text)

    def run_chain(
        self,
        client: Any,
        first: tuple[Sequence[str], Sequence[str | bytes | int | float]],
        second: tuple[Sequence[str], Sequence[str | bytes | int | float]],
    ) -> Any:
        """Run a ``chain`` with each part's (keys, args)."""
        (keys1, args1), (keys2, args2) = first, second
        return self(client, [*keys1, *keys2], [len(keys1), len(args1), *args1, *args2])

    def __call__(
        self, client: Any, keys: Sequence[str], args: Sequence[str | bytes | int | float] = ()
    ) -> Any:
        """Run it on ``client`` with ``keys`` and ``args``; loaded there first if needed."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.text)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def after(
        self,
        client: Any,
        commands: Sequence[Sequence[str | bytes | int]],
        keys: Sequence[str],
        args: Sequence[str | bytes | int | float] = (),
    ) -> Any:
        """Run it right after ``commands`` (each a command's words) in one round trip: a
        pipeline, not a transaction, so they must not depend on its answer, and what they
        write must be harmless if it then fails. Their first error is raised."""
        pipe = client.pipeline(transaction=False)
        for words in commands:
            pipe.execute_command(*words)
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        *replies, answer = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if isinstance(answer, NoScriptError):
            client.script_load(self.text)
            return client.evalsha(self.sha, len(keys), *keys, *args)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


# The global miss queue (app/queue/).
QUEUE_SUBMIT = Script("queue_submit")
QUEUE_WATCH = Script("queue_watch")
QUEUE_CANCEL = Script("queue_cancel")
QUEUE_LANES = Script("queue_lanes")
QUEUE_TAKE = Script("queue_take")
QUEUE_STALE = Script("queue_stale")
QUEUE_FINISH = Script("queue_finish")
QUEUE_RELEASE = Script("queue_release")
QUEUE_RETRY = Script("queue_retry")
QUEUE_VIEW = Script("queue_view")  # read-only: app/queue/inspect.py
# An engine's finish of its call's tickets and its next take, in one call (``claims.py``;
# made of the two files, so not in ``ALL``).
QUEUE_FINISH_TAKE = Script.chain(QUEUE_FINISH, QUEUE_TAKE)
# A tenant's quotas (app/cache/quotas.py) and rate limits (app/cache/rate_limit.py).
QUOTA_SLOTS = Script("quota_slots")
QUOTA_ENGINE_TIME = Script("quota_engine_time")
RATE_LIMIT_GCRA = Script("rate_limit_gcra")
# The pixel tier's index (app/cache/pixel_index.py).
PIXEL_RECORD = Script("pixel_record")
# Document jobs (app/jobs/store.py).
JOB_TRANSITION = Script("job_transition")
JOB_PAGE = Script("job_page")

ALL = (
    QUEUE_SUBMIT, QUEUE_WATCH, QUEUE_CANCEL, QUEUE_LANES, QUEUE_TAKE, QUEUE_STALE,
    QUEUE_FINISH, QUEUE_RELEASE, QUEUE_RETRY, QUEUE_VIEW, QUOTA_SLOTS, QUOTA_ENGINE_TIME,
    RATE_LIMIT_GCRA,
    PIXEL_RECORD, JOB_TRANSITION, JOB_PAGE,
)  # fmt: skip
