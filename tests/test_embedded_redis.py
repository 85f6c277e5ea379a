"""The private Redis server of `make run` and the tests (app/embedded_redis.py): it reports
its own start, never another server's. A port from ``free_port()`` may be taken by another
process before ours binds it; a start that only pinged the port would then hand its caller
that other server (in CI, another test's cluster node)."""

from __future__ import annotations

import pytest
import redis

from app.embedded_redis import EmbeddedRedis

pytestmark = pytest.mark.integration


def test_a_start_on_a_port_another_server_holds_fails_and_says_why() -> None:
    with EmbeddedRedis() as holder:
        intruder = EmbeddedRedis(port=holder.port)
        with pytest.raises(RuntimeError, match="exited"):
            intruder.start()
        intruder.cleanup()
        # The holder is untouched and still the one answering.
        assert redis.Redis(port=holder.port).info("server")["process_id"] == holder.proc.pid


def test_a_start_answers_from_its_own_process() -> None:
    with EmbeddedRedis() as server:
        assert server.proc is not None
        assert redis.Redis(port=server.port).info("server")["process_id"] == server.proc.pid
