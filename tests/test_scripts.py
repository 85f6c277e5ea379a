"""Every Lua script (``app/cache/scripts/*.lua``) run by the registry on a real Redis and on a
real three-primary Redis Cluster (``redis-server`` on free loopback ports, started once for
this module): each one does what its header says, and on the cluster everything it wrote
lies in the slot of its ``KEYS`` (a key named outside its hash tag would have failed there,
or landed in another slot)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from app.cache import scripts
from app.cache.keys import KeySpace, QueueKeys
from app.embedded_redis import EmbeddedRedis
from app.queue import inspect
from tests.fleet import LoopbackCluster

pytestmark = pytest.mark.integration

GROUP = "engines"


@pytest.fixture(scope="module")
def single() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[EmbeddedRedis]]:
    three = LoopbackCluster(masters=3, replicas=0).start()
    try:
        yield three.nodes
    finally:
        three.stop()


@pytest.fixture(params=["single", "cluster"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "single":
        server = request.getfixturevalue("single")
        plain = redis.Redis(port=server.port)
        plain.flushall()
        yield plain
        plain.close()
        return
    nodes = request.getfixturevalue("cluster")
    spread = RedisCluster(host="127.0.0.1", port=nodes[0].port)
    spread.flushall()
    yield spread
    _all_in_slots(spread)
    spread.close()


# The keys each test may write: on the cluster, each must lie in one of their slots.
_EXPECTED_SLOTS: list[int] = []


def _expect(client: Any, *keys: str) -> None:
    """Every key this test writes must share a slot with one of ``keys``."""
    _EXPECTED_SLOTS.clear()
    if isinstance(client, RedisCluster):
        _EXPECTED_SLOTS.extend(client.keyslot(key) for key in keys)


def _all_in_slots(client: RedisCluster) -> None:
    found = list(client.scan_iter(count=1000))
    stray = [k for k in found if client.keyslot(k) not in _EXPECTED_SLOTS]
    assert not stray, f"keys outside the scripts' slots: {stray}"


# The global miss queue -------------------------------------------------------------------


def queue(client: Any) -> QueueKeys:
    names = KeySpace("ocr", "fingerprint").dispatch()
    _expect(client, names.ring)
    return names


def live_engine(client: Any, names: QueueKeys, consumer: str = "engine-1") -> None:
    seconds, micros = client.time()
    client.zadd(names.engines, {consumer: seconds * 1000 + micros // 1000})


def submit(
    client: Any, names: QueueKeys, lane: str, entry: str, *, per_engine: int = 8
) -> list[Any]:
    marker = names.marker(entry, "sha")
    keys = [names.stream(lane), names.engines, marker, names.ring, names.lanes, names.shares,
            names.bell, names.interject_bell, names.stream_prefix]  # fmt: skip
    seconds, micros = client.time()  # the front's clock: the server's here
    now = seconds * 1000 + micros // 1000
    args = [GROUP, per_engine, 10_000, 60_000, lane, "2", now, "key", entry, "fmt", "2"]
    return scripts.QUEUE_SUBMIT(client, keys, args)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_submit_with_no_live_engine_queues_and_bounds_the_lane_as_for_one(client: Any) -> None:
    """Scaled to zero: the ticket waits for an engine to start; the lane holds what it holds
    for one engine, and each doorbell one ring (none is listening)."""
    names = queue(client)
    first = submit(client, names, "z", "z1", per_engine=2)
    assert text(first[0]) and [int(v) for v in first[1:3]] == [1, 0]  # waiting, engines
    assert int(submit(client, names, "z", "z2", per_engine=2)[1]) == 2
    assert client.lrange(names.bell, 0, -1) == [b"1"]
    assert client.lrange(names.interject_bell, 0, -1) == [b"1"]
    full = submit(client, names, "z", "z3", per_engine=2)
    assert text(full[0]) == "" and int(full[1]) == 2 and client.xlen(names.stream("z")) == 2


def test_only_a_lanes_first_waiting_ticket_looks_for_it_in_the_ring(client: Any) -> None:
    """The ring holds every lane with tickets waiting: a submission to such a lane skips the
    ring's scan (one command a miss, and a scan as long as the tenants waiting); a lane whose
    tickets all left (taken, or the ring lost to the LRU and not yet put back) looks again."""
    names = queue(client)
    live_engine(client, names)

    def looks() -> int:
        return int(client.info("commandstats").get("cmdstat_lpos", {}).get("calls", 0))

    before = looks()
    submit(client, names, "a", "e1")
    submit(client, names, "a", "e2")
    assert looks() - before == 1 and client.lrange(names.ring, 0, -1) == [b"a"]
    client.xtrim(names.stream("a"), maxlen=0)  # its tickets gone (taken and finished)
    client.delete(names.ring)
    submit(client, names, "a", "e3")
    assert looks() - before == 2 and client.lrange(names.ring, 0, -1) == [b"a"]


def test_submit_adds_to_a_lane_joins_a_queued_ticket_and_bounds_the_lane(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    answer = submit(client, names, "a", "e1")
    ticket = text(answer[0])
    assert [int(v) for v in answer[1:3]] == [1, 1]  # waiting in its lane, live engines
    assert text(client.get(names.marker("e1", "sha"))) == ticket
    assert client.lrange(names.ring, 0, -1) == [b"a"]
    assert client.smembers(names.lanes) == {b"a"}
    assert client.hget(names.shares, "a") == b"2"
    assert client.lrange(names.bell, 0, -1) == [b"1"]
    assert client.lrange(names.interject_bell, 0, -1) == [b"1"]
    (entry_id, fields), = client.xrange(names.stream("a"))  # fmt: skip
    assert text(entry_id) == ticket and fields == {b"key": b"e1", b"fmt": b"2"}
    joined = submit(client, names, "a", "e1")
    assert text(joined[0]) == ticket and int(joined[1]) == -1  # the same entry: joined
    assert text(joined[3]) == "a"
    # The same image from another lane (a document job's page) joins that ticket too, and
    # is told its lane; no second ticket, the marker left as it was.
    across = submit(client, names, "a+jobs", "e1")
    assert text(across[0]) == ticket and int(across[1]) == -1 and text(across[3]) == "a"
    assert client.xlen(names.stream("a+jobs")) == 0
    assert text(client.get(names.marker("e1", "sha"))) == ticket
    answer = submit(client, names, "b", "e2", per_engine=1)
    assert [int(v) for v in answer[1:3]] == [1, 1]  # its lane's waiting tickets, live engines
    full = submit(client, names, "a", "e3", per_engine=1)
    assert text(full[0]) == "" and int(full[1]) == 1  # a's lane holds its one per engine


def test_watch_tells_which_tickets_are_queued_and_puts_their_lane_back(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    first = text(submit(client, names, "a", "e1")[0])
    submit(client, names, "a", "e2")  # between: someone else's
    last = text(submit(client, names, "a", "e3")[0])
    client.delete(names.ring, names.lanes, names.bell)  # taken by the LRU
    client.hset(names.deficits, "a", "-3.0")  # from a round robin the LRU's ring forgot
    keys = [names.stream("a"), names.ring, names.lanes, names.bell, names.engines, names.deficits]

    states: list[int] = []  # each check's: 1 tickets wait untaken, 2 a holder silent, 0 neither

    def watch(*ids: str) -> set[str]:
        seconds, _ = client.time()
        args = ["a", GROUP, seconds * 1000 - 10_000, "-interject", min(ids), max(ids), *ids]
        present, state = scripts.QUEUE_WATCH(client, keys, args)
        states.append(int(state))
        return {text(found) for found in present}

    assert watch(first, last) == {first, last}  # one range read; the ticket between not told
    assert client.lrange(names.ring, 0, -1) == [b"a"] and client.smembers(names.lanes) == {b"a"}
    assert client.hget(names.deficits, "a") is None  # put back just active
    assert client.lrange(names.bell, 0, -1) == [b"1"]  # the idle engines hear of them
    assert watch(first, last) == {first, last}
    assert client.lrange(names.bell, 0, -1) == [b"1"]  # rung already: not again
    client.delete(names.bell)
    client.xreadgroup(GROUP, "engine-1", {names.stream("a"): ">"})  # all held by a live engine
    assert watch(first, last) == {first, last}
    assert client.lrange(names.bell, 0, -1) == []  # its engine computes them: nothing waits
    seconds, _ = client.time()
    client.zadd(names.engines, {"engine-1": seconds * 1000 - 60_000})  # it stopped reporting
    assert watch(first) == {first}
    assert client.lrange(names.bell, 0, -1) == [b"retry"]  # its tickets to reclaim
    client.xdel(names.stream("a"), first)
    client.delete(names.ring, names.bell)
    assert watch(first) == set()  # gone: nothing repaired for it
    assert client.lrange(names.ring, 0, -1) == [] and client.lrange(names.bell, 0, -1) == []
    assert states == [1, 1, 0, 2, 0]


def test_cancel_withdraws_only_an_undelivered_ticket(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    ticket = text(submit(client, names, "a", "e1")[0])
    keys = [names.stream("a"), names.marker("e1", "sha")]
    assert scripts.QUEUE_CANCEL(client, keys, [GROUP, ticket]) == 1
    assert client.xlen(names.stream("a")) == 0 and not client.exists(names.marker("e1", "sha"))
    ticket = text(submit(client, names, "a", "e1")[0])
    client.xreadgroup(GROUP, "engine-1", {names.stream("a"): ">"})  # an engine runs it
    assert scripts.QUEUE_CANCEL(client, keys, [GROUP, ticket]) == 0
    assert client.xlen(names.stream("a")) == 1


def upkeep(client: Any, names: QueueKeys) -> list[Any]:
    keys = [names.lanes, names.ring, names.bell, names.stream_prefix, names.deficits]
    return scripts.QUEUE_LANES(client, keys, [GROUP])


def test_the_lanes_upkeep_reads_every_lane_and_keeps_the_ring_whole(client: Any) -> None:
    names = queue(client)
    live_engine(client, names, "other")
    submit(client, names, "a", "e1")
    submit(client, names, "a", "e2")
    submit(client, names, "b", "e3")
    client.xreadgroup(GROUP, "other", {names.stream("b"): ">"})  # b's one ticket runs
    client.delete(names.ring)
    # Left from the round robin of the ring the LRU took: a lane out of the ring has none.
    client.hset(names.deficits, mapping={"a": "-3.0", "b": "1.5"})
    client.sadd(names.lanes, "gone")  # a lane without a stream, out of the ring
    answer = upkeep(client, names)
    lanes = {text(answer[i]): int(answer[i + 1]) for i in range(0, len(answer), 2)}
    assert lanes == {"a": 2, "b": 0}
    assert client.lrange(names.ring, 0, -1) == [b"a"]  # back in the ring: it has waiting
    assert client.hget(names.deficits, "a") is None  # just active: alone, it owes nobody
    assert client.hget(names.deficits, "b") is None  # out of the ring: rejoins just active
    assert client.smembers(names.lanes) == {b"a", b"b"}  # "gone" forgotten
    assert client.lrange(names.bell, 0, -1) == [b"1"]  # rung by the submissions: left as is
    client.delete(names.bell)  # the rings lost (the LRU took the list): rung once again
    upkeep(client, names)
    assert client.lrange(names.bell, 0, -1) == [b"1"]


def test_submit_says_how_many_rings_no_idle_engine_heard_and_engines_hold_its_lane(
    client: Any,
) -> None:
    """The submit's fourth and fifth answers: the idle engines' bell's rings unheard, its own
    included, and the engines holding tickets of its lane (a front whose ticket waits behind
    busy engines asks another queue shard for help)."""
    names = queue(client)
    live_engine(client, names, "e1")
    live_engine(client, names, "e2")
    assert int(submit(client, names, "a", "k1")[3]) == 1  # rung: an idle engine may hear it
    assert int(submit(client, names, "a", "k2")[3]) == 2  # the first ring unheard: all busy
    assert int(submit(client, names, "a", "k3")[3]) == 0  # as many waiting as engines: no ring
    client.lpop(names.bell, 2)  # an engine heard them
    client.xreadgroup(GROUP, "e1", {names.stream("a"): ">"}, count=2)  # and took two
    answer = [int(v) for v in submit(client, names, "a", "k4")[1:]]
    assert answer == [2, 2, 1, 1]  # waiting, engines, rings, one engine busy with the lane
    client.xreadgroup(GROUP, "e2", {names.stream("a"): ">"}, count=2)  # k4's ring unheard
    assert [int(v) for v in submit(client, names, "a", "k5")[1:]] == [1, 2, 2, 2]


def test_submit_counts_live_engines_by_their_reports_and_keeps_the_dead_for_reaping(
    client: Any,
) -> None:
    """The register keeps an engine that stopped reporting (others reap its tickets, then
    remove it: ``queue_stale``); the lane's bound counts only the live ones."""
    names = queue(client)
    live_engine(client, names, "live")
    seconds, _ = client.time()
    client.zadd(names.engines, {"dead": (seconds - 60) * 1000})
    answer = submit(client, names, "a", "e1")
    assert int(answer[2]) == 1  # one live engine
    assert client.zscore(names.engines, "dead") is not None


def take(client: Any, names: QueueKeys, consumer: str, *interject: str) -> list[Any]:
    """``interject``: the live window, the paused call's lane, its engine, "1" to pass on."""
    keys = [names.ring, names.deficits, names.shares, names.costs, names.engines, names.lanes,
            names.stream_prefix, names.engine_bell_prefix]  # fmt: skip
    window, paused, pauser, pass_on = (*interject, "", "", "", "")[:4]
    return scripts.QUEUE_TAKE(
        client, keys, [GROUP, consumer, 1, "0.5", window, paused, pauser, pass_on]
    )


def test_take_serves_the_lane_with_the_most_credit_and_charges_it(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    for i in range(3):
        submit(client, names, "a", f"a{i}")
    submit(client, names, "b", "b0")
    client.delete(names.ring)
    client.rpush(names.ring, "a", "b")
    client.hset(names.deficits, "b", "2.0")  # b has the most credit
    lane, entries, cost = take(client, names, "engine-1")
    assert text(lane) == "b" and len(entries) == 1 and float(cost) == 0.5  # the fallback cost
    assert float(client.hget(names.deficits, "b")) == pytest.approx(1.5)
    assert client.xpending(names.stream("b"), GROUP)["pending"] == 1
    lane, entries, _ = take(client, names, "engine-1")  # b has nothing left waiting: a
    assert text(lane) == "a" and client.hget(names.deficits, "b") is None
    assert client.lrange(names.ring, 0, -1) == [b"a"]


def test_a_lane_alone_is_read_in_turn_without_a_deficit(client: Any) -> None:
    """One lane in the ring owes nobody: the pass that leaves it alone drops its deficit and
    charges its ticket nothing (-1: its finish corrects no deficit a later pass writes), and
    its tickets are then read in ring order, charged nothing, in three commands; once it is
    empty it leaves the ring (the full pass)."""
    names = queue(client)
    live_engine(client, names)
    a0, a1, a2 = (text(submit(client, names, "a", f"a{i}")[0]) for i in range(3))
    submit(client, names, "b", "b0")  # the ring: b, a (both just active)
    client.hset(names.costs, mapping={"a": "0.25", "b": "0.25"})
    lane, _, cost = take(client, names, "engine-1")
    assert text(lane) == "b" and float(cost) == 0.25  # round robin: charged
    assert client.hget(names.deficits, "a") is not None
    lane, entries, cost = take(client, names, "engine-1")  # b empty: a left alone, uncharged
    assert text(lane) == "a" and [text(e[0]) for e in entries] == [a0] and float(cost) == -1
    assert client.lrange(names.ring, 0, -1) == [b"a"] and client.hget(names.deficits, "a") is None
    before = _commands(client)
    lane, entries, cost = take(client, names, "engine-1")
    if before is not None:  # EVALSHA, LRANGE, XREADGROUP (and the INFO)
        assert _commands(client) - before == 4
    assert text(lane) == "a" and [text(e[0]) for e in entries] == [a1]
    assert float(cost) == -1 and client.hget(names.deficits, "a") is None
    assert [text(e[0]) for e in take(client, names, "engine-1")[1]] == [a2]
    assert take(client, names, "engine-1") == [] and client.llen(names.ring) == 0


def _commands(client: Any) -> int | None:
    """The server's commands processed so far (a single server; None on a cluster)."""
    if not isinstance(client, redis.Redis):
        return None
    return int(client.info("stats")["total_commands_processed"])


def test_take_interjects_only_while_every_live_engine_is_busy(client: Any) -> None:
    names = queue(client)
    live_engine(client, names, "e1")
    live_engine(client, names, "e2")
    submit(client, names, "a", "a0")
    submit(client, names, "a", "a1")
    submit(client, names, "b", "b0")
    client.xreadgroup(GROUP, "e1", {names.stream("a"): ">"}, count=1)  # e1 runs a0; e2 idle
    ring = client.lrange(names.ring, 0, -1)
    assert take(client, names, "i", "10000") == []
    assert client.lrange(names.ring, 0, -1) == ring  # a declined take leaves the ring
    client.xreadgroup(GROUP, "e2", {names.stream("a"): ">"}, count=1)  # now both are busy
    lane, entries, _ = take(client, names, "i", "10000")
    assert text(lane) == "b" and len(entries) == 1


def test_a_document_jobs_lane_never_interjects(client: Any) -> None:
    """Every engine busy, a job's page waiting with nothing of its lane running: it waits
    for an engine (an idle engine's take gives it); a request's lane would interject."""
    names = queue(client)
    live_engine(client, names, "e1")
    submit(client, names, "a", "a0")
    submit(client, names, "a+jobs", "j0")
    client.xreadgroup(GROUP, "e1", {names.stream("a"): ">"}, count=1)  # e1 busy with a0
    assert take(client, names, "i", "10000") == []
    lane, entries, _ = take(client, names, "e1")  # the engine free again takes it
    assert text(lane) == "a+jobs" and len(entries) == 1


def test_interjection_passes_over_a_lane_running_elsewhere_but_not_one_in_debt(
    client: Any,
) -> None:
    """A flood holding every engine with credit banked (its tickets cost less than charged)
    does not keep a lane with nothing running waiting: the interjector takes that lane's
    ticket. A lane in debt waits its turn (nothing given, the ring as it was)."""
    names = queue(client)
    live_engine(client, names, "e1")
    live_engine(client, names, "e2")
    for i in range(3):
        submit(client, names, "a", f"a{i}")
    client.xreadgroup(GROUP, "e1", {names.stream("a"): ">"}, count=1)
    client.xreadgroup(GROUP, "e2", {names.stream("a"): ">"}, count=1)  # a holds both engines
    submit(client, names, "b", "b0")
    client.delete(names.ring)
    client.rpush(names.ring, "a", "b")
    client.hset(names.deficits, mapping={"a": "10.0", "b": "-3.0"})  # b in debt
    ring = client.lrange(names.ring, 0, -1)
    assert take(client, names, "i", "10000") == []
    assert client.lrange(names.ring, 0, -1) == ring
    client.hset(names.deficits, "b", "0.25")  # b owed a turn, a owed more
    lane, entries, _ = take(client, names, "i", "10000")
    assert text(lane) == "b" and len(entries) == 1
    assert float(client.hget(names.deficits, "a")) == 10.0  # a's credit untouched
    lane, entries, _ = take(client, names, "engine-3")  # a feeder (no interjection): a's turn
    assert text(lane) == "a"


def test_a_declined_interjection_rings_the_engine_that_alone_runs_the_lane(client: Any) -> None:
    """e1 runs a's page, e2 b's; b's next page may go only inside e2's call. e1's interjector
    heard the shared ring: it takes nothing and, told to pass, rings e2's own bell, once;
    e2's interjector (its call of lane b alone) takes the page."""
    names = queue(client)
    live_engine(client, names, "e1")
    live_engine(client, names, "e2")
    submit(client, names, "a", "a0")
    submit(client, names, "b", "b0")
    client.xreadgroup(GROUP, "e1", {names.stream("a"): ">"}, count=1)
    [[_, held]] = client.xreadgroup(GROUP, "e2", {names.stream("b"): ">"}, count=1)
    held_b = [entry_id for entry_id, _ in held]
    submit(client, names, "b", "b1")
    own = names.engine_bell_prefix
    assert take(client, names, "e1-interject", "10000", "a", "e1") == []  # not told to pass
    assert not client.exists(own + "e2")
    for _ in range(2):
        assert take(client, names, "e1-interject", "10000", "a", "e1", "1") == []
    assert client.lrange(own + "e2", 0, -1) == [b"passed"]  # once, however often passed
    assert 0 < client.pttl(own + "e2") <= 10000 and not client.exists(own + "e1")
    client.delete(own + "e2")
    assert take(client, names, "e2-interject", "10000", "x", "e2", "1") == []  # b's own engine
    assert not client.exists(own + "e2")  # does not ring itself
    submit(client, names, "c", "c0")  # e2 busy with c's page, b's held by its interjector
    client.xreadgroup(GROUP, "e2", {names.stream("c"): ">"}, count=1)
    client.xclaim(names.stream("b"), GROUP, "e2-interject", 0, [text(b) for b in held_b])
    assert take(client, names, "e1-interject", "10000", "a", "e1", "1") == []
    assert not client.exists(own + "e2-interject")  # an interjector's hold: no engine to ring
    client.xclaim(names.stream("b"), GROUP, "e2", 0, [text(b) for b in held_b])
    lane, entries, _ = take(client, names, "e2-interject", "10000", "b", "e2", "1")
    assert text(lane) == "b" and len(entries) == 1


def test_stale_lists_the_tickets_whose_holder_stopped(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    ticket = text(submit(client, names, "a", "e1")[0])
    running = text(submit(client, names, "a", "e2")[0])
    handed = text(submit(client, names, "b", "e3")[0])
    client.xreadgroup(GROUP, "dead", {names.stream("a"): ">"}, count=1)
    client.xreadgroup(GROUP, "engine-1-interject", {names.stream("a"): ">"}, count=1)  # live
    client.xreadgroup(GROUP, "engine-1:handed", {names.stream("b"): ">"})  # no engine's name
    seconds, _ = client.time()
    now_ms = seconds * 1000
    client.zadd(names.engines, {"dead": now_ms - 60_000, "idle-dead": now_ms - 60_000})
    keys = [names.lanes, names.stream_prefix, names.engines]
    # Called by engine-1's process, which runs the ticket its interjector holds.
    mine = [GROUP, 10, now_ms - 10_000, "-interject", "engine-1-"]
    stale = scripts.QUEUE_STALE(client, keys, [*mine, running])
    # Taken a moment ago, not touched since: what counts is that its holder stopped reporting.
    found = [text(v) for v in stale]
    # Not the running one: its engine reports (a long call is not reclaimed).
    assert sorted(zip(found[0::4], found[1::4], found[2::4], strict=True)) == [
        ("a", ticket, "dead"),
        ("b", handed, "engine-1:handed"),
    ]
    assert (running, "engine-1-interject") not in zip(found[1::4], found[2::4], strict=True)
    # Not running it any more (a failed finish, a take whose answer was lost): an orphan.
    orphaned = [text(v) for v in scripts.QUEUE_STALE(client, keys, mine)]
    assert ("a", running, "engine-1-interject") in zip(
        orphaned[0::4], orphaned[1::4], orphaned[2::4], strict=True
    )
    # The engines gone from the register once they hold nothing: "dead" still holds a ticket.
    assert client.zscore(names.engines, "idle-dead") is None
    assert client.zscore(names.engines, "dead") is not None
    assert client.zscore(names.engines, "engine-1") is not None  # live
    assert (
        len(scripts.QUEUE_STALE(client, keys, [GROUP, 1, now_ms - 10_000, "-interject", ""])) == 4
    )  # at most 1


def test_finish_acknowledges_deletes_and_corrects_the_lanes_deficit(client: Any) -> None:
    names = queue(client)
    live_engine(client, names)
    ticket = text(submit(client, names, "a", "e1")[0])
    submit(client, names, "b", "e2")  # two lanes: the round robin keeps their deficits
    client.delete(names.ring)
    client.rpush(names.ring, "a", "b")
    take(client, names, "engine-1")
    deficit = float(client.hget(names.deficits, "a"))
    marker = names.marker("e1", "sha")
    keys = [names.stream("a"), names.deficits, names.costs, marker]
    assert scripts.QUEUE_FINISH(client, keys, [GROUP, "a", "0.5", "2.5", 1, ticket]) == 1
    assert client.xlen(names.stream("a")) == 0 and not client.exists(marker)
    assert client.xpending(names.stream("a"), GROUP)["pending"] == 0
    assert float(client.hget(names.deficits, "a")) == pytest.approx(deficit - 2.0)
    assert float(client.hget(names.costs, "a")) == pytest.approx(2.5)  # its first sample
    # Taken from a lane alone (charged nothing, "-1"): its deficit is not corrected.
    other = text(submit(client, names, "b", "e3")[0])
    client.xreadgroup(GROUP, "engine-1", {names.stream("b"): ">"})
    client.hset(names.deficits, "b", "1.0")  # a round robin's, written since
    keys = [names.stream("b"), names.deficits, names.costs, names.marker("e3", "sha")]
    assert scripts.QUEUE_FINISH(client, keys, [GROUP, "b", "-1", "2.5", 1, other]) == 1
    assert float(client.hget(names.deficits, "b")) == 1.0


# Document jobs -----------------------------------------------------------------------

JOB = "ocr:job:{job_abc}"


def test_finish_and_the_next_take_run_as_one_script(client: Any) -> None:
    """``QUEUE_FINISH_TAKE``: the engine's finish of its call and its next take, one call;
    the finish removes the ticket's marker and image (a newer ticket's are left alone)."""
    names = queue(client)
    live_engine(client, names)
    first = text(submit(client, names, "a", "e1")[0])
    second = text(submit(client, names, "a", "e2")[0])
    newer = text(submit(client, names, "a", "e3")[0])
    assert [text(e[0]) for e in take(client, names, "engine-1")[1]] == [first]
    marker, image = names.marker("e1", "sha"), names.image("e1", "sha")
    client.set(image, b"png")
    finish = ([names.stream("a"), names.deficits, names.costs, marker, image],
              [GROUP, "a", "1.0", "1.5", 1, first])  # fmt: skip
    keys = [names.ring, names.deficits, names.shares, names.costs, names.engines,
            names.lanes, names.stream_prefix, names.engine_bell_prefix]  # fmt: skip
    args = [GROUP, "engine-1", 1, "1.000000", "", "", "", ""]
    answer = scripts.QUEUE_FINISH_TAKE.run_chain(client, finish, (keys, args))
    assert text(answer[0]) == "a" and [text(e[0]) for e in answer[1]] == [second]
    assert not client.exists(marker) and not client.exists(image)
    assert [text(e[0]) for e in client.xrange(names.stream("a"))] == [second, newer]
    assert float(client.hget(names.costs, "a")) == pytest.approx(1.5)
    # A marker that names a newer ticket keeps it and its image.
    client.set(names.marker("e2", "sha"), newer)
    client.set(names.image("e2", "sha"), b"png")
    again = ([names.stream("a"), names.deficits, names.costs, names.marker("e2", "sha"),
              names.image("e2", "sha")], [GROUP, "a", "1.0", "1.0", 1, second])  # fmt: skip
    scripts.QUEUE_FINISH_TAKE.run_chain(client, again, (keys, args))
    assert client.exists(names.marker("e2", "sha"), names.image("e2", "sha")) == 2


def transition(client: Any, status: str, *leaving: str) -> str:
    keys = [JOB, f"{JOB}:doc"]
    return text(scripts.JOB_TRANSITION(client, keys, [status, "12.5", "", *leaving]))


def test_a_job_changes_status_only_from_the_statuses_it_may_leave(client: Any) -> None:
    _expect(client, JOB)
    assert transition(client, "running", "queued") == ""  # no record: nothing written
    assert not client.exists(JOB)
    client.hset(JOB, "job", "{}")
    client.set(f"{JOB}:doc", b"%PDF-")
    assert transition(client, "running", "queued") == "running"
    assert client.hget(JOB, "started") == b"12.5"
    assert transition(client, "cancelled", "queued", "running") == "cancelled"
    assert not client.exists(f"{JOB}:doc")  # a cancelled job's document goes at once
    # The end that comes after the cancel does not overwrite it, nor a second cancel.
    assert transition(client, "succeeded", "queued", "running") == "cancelled"
    assert transition(client, "cancelled", "queued", "running") == "cancelled"
    assert client.hget(JOB, "status") == b"cancelled"


def test_a_jobs_page_is_recorded_once_with_its_count(client: Any) -> None:
    _expect(client, JOB)
    keys = [f"{JOB}:pages", JOB, f"{JOB}:doc"]
    assert scripts.JOB_PAGE(client, keys, ["1", b'{"page": 1}', "done", 60]) == -1  # no job
    assert not client.exists(f"{JOB}:pages")
    client.hset(JOB, "job", "{}")
    assert scripts.JOB_PAGE(client, keys, ["1", b'{"page": 1}', "done", 60]) == 1
    assert scripts.JOB_PAGE(client, keys, ["1", b'{"page": 9}', "done", 60]) == 0  # first stays
    assert scripts.JOB_PAGE(client, keys, ["2", b'{"error": 1}', "failed", 60]) == 1
    assert client.hgetall(f"{JOB}:pages") == {b"1": b'{"page": 1}', b"2": b'{"error": 1}'}
    assert client.hmget(JOB, "done", "failed") == [b"1", b"1"]
    assert 0 < client.ttl(JOB) <= 60 and 0 < client.ttl(f"{JOB}:pages") <= 60


def test_release_frees_the_key_only_for_its_own_ticket(client: Any) -> None:
    names = queue(client)
    marker = names.marker("e1", "sha")
    client.set(marker, "2-0")
    assert scripts.QUEUE_RELEASE(client, [marker], ["1-0"]) == 0 and client.exists(marker)
    assert scripts.QUEUE_RELEASE(client, [marker], ["2-0"]) == 1 and not client.exists(marker)


# Quotas, rate limits, the pixel index ----------------------------------------------------


def test_view_reads_every_lane_and_engine_and_writes_nothing(client: Any) -> None:
    names = queue(client)
    empty = inspect.read(client, names, live_ms=3000)  # no key at all
    assert (empty.lanes, empty.engines, empty.oldest_wait_ms) == ((), (), None)
    live_engine(client, names, "engine-1")
    for lane, entry in (("a", "e1"), ("a", "e2"), ("b", "e3"), ("a", "e4")):
        submit(client, names, lane, entry)
    client.xreadgroup(GROUP, "engine-1", {names.stream("a"): ">"}, count=1)  # e1
    client.xreadgroup(GROUP, "engine-1-interject", {names.stream("b"): ">"}, count=1)  # e3
    client.xreadgroup(GROUP, "gone", {names.stream("a"): ">"}, count=1)  # e2: its holder died
    client.hset(names.deficits, "a", "-0.500000")
    client.hset(names.costs, "a", "0.250000")
    (last, _), = client.xrange(names.stream("a"), "-", "+")[-1:]  # fmt: skip
    before = {key: client.dump(key) for key in client.scan_iter()}
    view = inspect.read(client, names, live_ms=3000)
    assert {key: client.dump(key) for key in client.scan_iter()} == before
    lanes = {lane.lane: lane for lane in view.lanes}
    assert [(k, v.waiting, v.running) for k, v in lanes.items()] == [("a", 1, 2), ("b", 0, 1)]
    assert (lanes["a"].deficit, lanes["a"].cost, lanes["a"].share) == (-0.5, 0.25, 2.0)
    assert (lanes["b"].deficit, lanes["b"].cost, lanes["b"].oldest_wait_ms) == (None, None, None)
    assert lanes["a"].oldest_wait_ms == view.at_ms - inspect.enqueued_ms(text(last))  # e4's
    engines = {engine.consumer: engine for engine in view.engines}
    assert set(engines) == {"engine-1", "gone"}  # the interjector's tickets: its engine's
    assert engines["engine-1"].live and engines["engine-1"].running == 2
    holds = sorted((held.lane, held.as_json()["interjected"]) for held in engines["engine-1"].holds)
    assert holds == [("a", False), ("b", True)]
    gone = engines["gone"]
    assert (gone.live, gone.last_report_ms, gone.running, len(gone.holds)) == (False, None, 1, 1)
    assert (view.waiting, view.running, view.live, view.busy) == (1, 3, 1, 1)


def test_quota_slots_take_up_to_the_limit(client: Any) -> None:
    key = KeySpace("ocr", "fingerprint").quota("inflight", "tenant")
    _expect(client, key)
    taken = [scripts.QUOTA_SLOTS(client, [key], [2, 60_000, f"slot{i}"]) for i in range(3)]
    assert taken == [1, 1, 0]
    assert 60_000 < client.pttl(key) <= 61_000
    client.zadd(key, {"slot0": 0})  # expired: dropped on the next take
    assert scripts.QUOTA_SLOTS(client, [key], [2, 60_000, "slot3"]) == 1


def test_quota_engine_time_spends_and_tells_the_wait(client: Any) -> None:
    key = KeySpace("ocr", "fingerprint").quota("engine", "tenant")
    _expect(client, key)
    minute = 60_000_000
    assert scripts.QUOTA_ENGINE_TIME(client, [key], [0, minute]) == 0  # nothing spent
    assert scripts.QUOTA_ENGINE_TIME(client, [key], [2 * minute, minute]) == 0  # spent after
    wait = scripts.QUOTA_ENGINE_TIME(client, [key], [0, minute])
    assert 59_000 < wait <= 60_000  # a minute over its budget


def test_rate_limit_gcra_allows_the_burst_then_refuses(client: Any) -> None:
    key = KeySpace("ocr", "fingerprint").rate_limit("10.0.0.1")
    _expect(client, key)
    args = ["1000000", "1000000"]  # one a second, a burst of one
    answers = [scripts.RATE_LIMIT_GCRA(client, [key], [*args, "0"]) for _ in range(3)]
    assert answers[:2] == [[1, 0], [1, 0]]
    allowed, wait_ms = answers[2]
    assert allowed == 0 and 0 < wait_ms <= 1000
    assert scripts.RATE_LIMIT_GCRA(client, [key], [*args, "1"])[0] == 0  # looking is refused too


def test_pixel_record_keeps_the_bucket_bounded_and_the_newest_pointer(client: Any) -> None:
    key = KeySpace("ocr", "fingerprint").pixel_bucket("abcd", "ocr-task")
    _expect(client, key)
    for i in range(8):
        scripts.PIXEL_RECORD(client, [key], [f"field{i}", f"pointer{i}", 5000, 4, 2])
    assert client.hlen(key) <= 4
    assert client.hget(key, "field7") == b"pointer7"
    assert 4000 < client.pttl(key) <= 5000
    scripts.PIXEL_RECORD(client, [key], ["field8", "pointer8", 60_000, 4, 2])
    assert client.pttl(key) > 5000  # alive as long as its newest pointer


# The registry --------------------------------------------------------------------------


def test_a_script_the_server_does_not_know_is_loaded_and_run(client: Any) -> None:
    """After a restart, a failover or SCRIPT FLUSH: NOSCRIPT, then loaded and run."""
    names = queue(client)
    client.script_flush()
    assert not any(_exists(client, script.sha) for script in scripts.ALL)
    marker = names.marker("e1", "sha")
    client.set(marker, "1-0")
    assert scripts.QUEUE_RELEASE(client, [marker], ["1-0"]) == 1
    assert _exists(client, scripts.QUEUE_RELEASE.sha)


def test_every_script_file_is_registered_with_its_header() -> None:
    files = sorted(p.stem for p in scripts.HERE.glob("*.lua"))
    assert files == sorted(script.name for script in scripts.ALL)
    for script in scripts.ALL:
        lines = script.text.splitlines()
        code = next(i for i, line in enumerate(lines) if not line.startswith("--"))
        header = "\n".join(lines[:code])
        assert code >= 5, f"{script.name}: no header comment"
        for part in ("atomic", "KEYS[1]", "ARGV[1]", "Other keys:", "Returns"):
            assert part in header, (script.name, part)


def _exists(client: Any, sha: str) -> bool:
    found = client.script_exists(sha)
    return bool(found[0] if isinstance(found, list) else found)
