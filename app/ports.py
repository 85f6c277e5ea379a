"""Loopback ports for the servers a process starts (an embedded Redis, a cluster's nodes, an
engine process, a test's server): one allocator for all of them.

A port is taken below the kernel's ephemeral range, so no outgoing connection can be given it
between the moment it is chosen and the moment its server binds it. It is reserved for this
process's lifetime by a lock on its byte of one shared file (``fcntl`` record locks, released
by the kernel when the process ends), so two processes choosing at once (pytest-xdist workers,
the fleet's second pytest process, a supervisor and its tests) never get the same port."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

LOWEST = 10000
_LOCK_FILE = Path(tempfile.gettempdir()) / "ocr-cache-ports.lock"
_mutex = threading.Lock()
_mine: set[int] = set()
_lock_fd: int | None = None


def ephemeral_range_start() -> int:
    """The kernel's first ephemeral port: ports below it are never handed out implicitly."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port reserved for this process."""
    return free_ports(1)[0]


def free_ports(count: int, *, consecutive: bool = False, offset: int = 0) -> list[int]:
    """``count`` free ports reserved for this process (``consecutive``: in a row). With
    ``offset``, port + ``offset`` is free and reserved too (a Redis Cluster node's bus port)."""
    high = ephemeral_range_start() - offset - count
    if high <= LOWEST:
        raise RuntimeError(f"no room below the ephemeral range ({ephemeral_range_start()})")
    width = count if consecutive else 1

    def run_of_ports() -> list[int]:
        start = random.randrange(LOWEST, high)
        return list(range(start, start + width))

    with _mutex:
        found: list[int] = []
        while len(found) < count:
            found += _find(run_of_ports, offset)
        return found


def _find(choose: Callable[[], list[int]], offset: int) -> list[int]:
    """The first choice whose ports (and their ``offset`` partners) could all be reserved."""
    for _ in range(2000):
        ports = choose()
        if _reserve(ports + [port + offset for port in ports] if offset else ports):
            return ports
    raise RuntimeError("no free loopback ports found")


def _reserve(ports: list[int]) -> bool:
    if len(set(ports)) != len(ports) or _mine & set(ports):
        return False
    locked: list[int] = []
    for port in ports:
        if not _lock(port) or not _bindable(port):
            for taken in locked + [port]:
                _unlock(taken)
            return False
        locked.append(port)
    _mine.update(ports)
    return True


def _fd() -> int | None:
    """The shared lock file, or None where it cannot be opened (another user's file): ports
    are then only checked free, as a lone process needs."""
    global _lock_fd
    if _lock_fd is None:
        try:
            _lock_fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            _lock_fd = -1
    return None if _lock_fd < 0 else _lock_fd


def _lock(port: int) -> bool:
    fd = _fd()
    if fd is None:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def _unlock(port: int) -> None:
    fd = _fd()
    if fd is not None:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, port)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
