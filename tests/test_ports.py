"""The one port allocator (``app.ports``): processes choosing at once never share a port, and
no port lies in the kernel's ephemeral range, where an outgoing connection could take it."""

from __future__ import annotations

import multiprocessing
import socket

import pytest

from app import ports

pytestmark = pytest.mark.integration  # processes


def _choose(out: multiprocessing.Queue, hold: multiprocessing.Event) -> None:  # type: ignore[type-arg]
    out.put(ports.free_ports(200) + ports.free_ports(5, consecutive=True))
    hold.wait(60)  # reservations last as long as their process


def test_processes_choosing_at_once_never_share_a_port():
    context = multiprocessing.get_context("fork")
    out, hold = context.Queue(), context.Event()
    children = [context.Process(target=_choose, args=(out, hold)) for _ in range(4)]
    for child in children:
        child.start()
    try:
        chosen = [out.get(timeout=60) for _ in children] + [ports.free_ports(200)]
    finally:
        hold.set()
        for child in children:
            child.join(30)
    every = [port for group in chosen for port in group]
    assert len(set(every)) == len(every) == 4 * 205 + 200
    assert max(every) < ports.ephemeral_range_start() and min(every) >= ports.LOWEST
    for group in chosen[:-1]:
        run = group[-5:]
        assert run == list(range(run[0], run[0] + 5))


def test_a_bus_port_partner_is_reserved_with_its_port():
    (port,) = ports.free_ports(1, offset=10000)
    assert port + 10000 < ports.ephemeral_range_start()
    later = set(ports.free_ports(300))
    assert not {port, port + 10000} & later


def test_a_port_another_program_listens_on_is_skipped(monkeypatch):
    """A port bound outside the allocator (another program's) is tried first and passed over."""
    randrange = ports.random.randrange
    tried: list[int] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        in_use = listener.getsockname()[1]

        def in_use_first(low: int, high: int) -> int:
            tried.append(in_use if len(tried) < 2 else randrange(low, high))
            return tried[-1]

        monkeypatch.setattr(ports.random, "randrange", in_use_first)
        chosen = ports.free_port()
    assert tried[:2] == [in_use, in_use] and chosen == tried[-1] != in_use
