"""`make chaos` (issue 25): the real images running together while their parts fail, every
answer checked.

The stack (docker/compose.chaos.yml on top of docker-compose.yml and compose.local.yml):
two replicas of the CPU front (``front``, ``front-b``, two workers each, no engine) whose
misses go through one global queue to one PaddleOCR engine (``engine``, two slots), a third
front (``front-serving``) whose engine (``engine-serving``) forwards to the Paddle Serving
sidecar, Redis small enough to evict (``allkeys-lru``, as in production) and SeaweedFS as the
cold tier (L3) of every front and engine. Figures read from /metrics are summed over the
fronts and the engines (their port 18100, published here; engine calls over the engines).

The verifying load: an open-loop request rate (a request is sent every ``1/rate`` s whether
or not the earlier ones answered) over corpus images whose true lines were computed before
the run by each engine (``Cache-Control: no-cache, no-store``), mixed with fresh images (one
pixel of a corpus image changed) so misses never stop; a fresh image's answer is checked
after the run against a ``no-cache, no-store`` answer of the same engine. Wrong = the text
lines differ. The in-process replicas are one engine (a load balancer's round robin
between them); each engine has its own truths.

Faults (``FAULTS``), each alone in its own window, then at random during one long run: a
front worker ``kill -9``; the engine process ``kill -9`` (its container restarts it); a front
container killed and restarted; Redis restarted empty; Redis
frozen 5 s (``docker pause``); Redis full and evicting, its queue keys taken as the LRU may
take them; the sidecar killed mid-request and restarted; SeaweedFS stopped and started; a
burst of requests that give up before the engine could answer them. Per fault: answers
checked, wrong answers, errors by status, how long errors lasted after the fault, time until
the hit ratio is back, engine calls per distinct computed image; at the end the L3 objects
missing for computed entries against the write-behind's own count of what it dropped.
``soak``: the same load without faults, each process's memory and open files after a warm-up
and at the end.

    python -m bench.chaos [--faults a,b] [--random SECONDS] [--ci]   # -> bench/results/chaos.json
    python -m bench.chaos soak --seconds 3600 --warmup 300

The Docker engine comes from ../shared/tools/container-engine.sh (up when none answers; down
at the end when this started it).
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import requests
from PIL import Image, ImageDraw, ImageFont

from tests.helpers import metric_sum
from tests.images.containers import PORT_TAKEN, Reserved, front_workers, processes

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared"))
CORPUS = SHARED / "corpus"
RESULTS = ROOT / "bench" / "results"
ENGINE_SCRIPT = Path(os.environ.get("CONTAINER_ENGINE", SHARED / "tools" / "container-engine.sh"))
PROJECT = os.environ.get("CHAOS_PROJECT", "ocr-chaos")
FILES = ["docker/docker-compose.yml", "docker/compose.local.yml", "docker/compose.chaos.yml"]
PADDLE, SERVING = "paddle", "serving"  # the two engines, each with its own truths
# Small real images: the misses stay cheap enough that 2 shared cores keep up with the rate.
HOT = [
    "tesseract_phototest.png",
    "paddleocr_word_en_1.png",
    "paddleocr_word_ch_4.jpg",
    "rapidocr_short.png",
    "mmocr_rec_1036169.jpg",
    "paddleocr_casia_0.jpg",
    "rapidocr_el_rec.jpg",
    "paddleocr_word_ru_1.jpg",
]
FRESH_BASES = [
    "paddleocr_word_en_1.png",
    "paddleocr_word_ch_4.jpg",
    "rapidocr_short.png",
    "mmocr_rec_1036169.jpg",
    "paddleocr_casia_0.jpg",
]
BURST_PAGES = [
    "tesseract_eurotext.png",
    "mmocr_wildreceipt_2.jpg",
    "paddleocr_doc_korean_1.jpg",
    "rapidocr_korean.jpg",
    "mmocr_demo_text_det.jpg",
    "paddleocr_doc_ger_1.jpg",
]


PORTS = (
    "CHAOS_REDIS_PORT", "CHAOS_FRONT_HTTP_PORT", "CHAOS_FRONT_GRPC_PORT", "CHAOS_FRONT_B_HTTP_PORT",
    "CHAOS_FRONT_B_GRPC_PORT", "CHAOS_SERVING_FRONT_HTTP_PORT", "CHAOS_SERVING_FRONT_GRPC_PORT",
    "CHAOS_S3_PORT", "CHAOS_ENGINE_PORT", "CHAOS_SERVING_ENGINE_PORT",
)  # fmt: skip


def distinct_free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now, below the kernel's ephemeral range and named
    in no compose file (``Reserved``): neither an outgoing connection (the load's own) nor a
    port Docker picks can take one between runs of the containers that publish them (a
    restarted container binds its port again). They are released for Docker to bind: another
    process binding one on purpose is still possible, and ``Stack.up`` then chooses again."""
    held = Reserved(n)
    held.close()
    return held.ports


# --- the stack ----------------------------------------------------------------------------


class Stack:
    """The compose project: up, down, its services' containers and processes."""

    def __init__(self, ci: bool) -> None:
        self.ci = ci  # no sidecar: the subset `make test-images` runs
        self.profiles = ["--profile", "l3"] + ([] if ci else ["--profile", "serving"])
        self.password = secrets.token_hex(12)
        self.s3_secret = secrets.token_hex(12)
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.ports = dict(zip(PORTS, distinct_free_ports(len(PORTS)), strict=True))
        self.env = {
            **os.environ,
            "REDIS_PASSWORD": self.password,
            "L3_SECRET_ACCESS_KEY": self.s3_secret,
        }
        self.env.update({name: str(port) for name, port in self.ports.items()})
        self.fronts = {
            "front": self.ports["CHAOS_FRONT_HTTP_PORT"],
            "front-b": self.ports["CHAOS_FRONT_B_HTTP_PORT"],
        }
        # The engines' own port (18100): /metrics only, never the load.
        self.engines = {"engine": self.ports["CHAOS_ENGINE_PORT"]}
        if not self.ci:
            self.fronts["front-serving"] = self.ports["CHAOS_SERVING_FRONT_HTTP_PORT"]
            self.engines["engine-serving"] = self.ports["CHAOS_SERVING_ENGINE_PORT"]

    def compose(self, *args: str, check: bool = True, timeout: float = 1800) -> str:
        cmd = ["docker", "compose", "-p", PROJECT]
        for f in FILES:
            cmd += ["-f", f]
        result = subprocess.run(
            cmd + self.profiles + list(args),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode:
            raise RuntimeError(f"compose {' '.join(args)}: {result.stderr[-3000:]}")
        return result.stdout

    def up(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)
        self.compose("build")
        for _ in range(3):  # a host port taken since it was chosen: choose again
            try:
                self.compose("up", "-d", "--wait", "--wait-timeout", "600")
                return
            except RuntimeError as exc:
                if not PORT_TAKEN.search(str(exc)):
                    raise
                self.compose("down", "--volumes", "--timeout", "10", check=False)
                self._choose_ports()
        raise RuntimeError("no free host ports after three tries")

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)

    def container(self, service: str) -> str:
        return f"{PROJECT}-{service}-1"

    def docker(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
        if check and result.returncode:
            raise RuntimeError(f"docker {' '.join(args)}: {result.stderr[-2000:]}")
        return result.stdout

    def redis(self) -> redis.Redis:
        return redis.Redis(
            port=self.ports["CHAOS_REDIS_PORT"],
            password=self.password,
            socket_timeout=10,
            socket_connect_timeout=5,
        )

    def processes(self, service: str) -> list[dict[str, Any]]:
        """Every process of a service: pid, parent, argv, resident memory (kB), open files."""
        return processes(self.container(service))

    def worker_pids(self, service: str) -> list[int]:
        return front_workers(self.container(service))

    def healthy(self, service: str) -> bool:
        out = self.docker(
            "inspect", "--format", "{{.State.Health.Status}}", self.container(service), check=False
        )
        return out.strip() == "healthy"

    def wait_healthy(self, service: str, timeout: float = 300) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.healthy(service):
                return time.monotonic() - start
            time.sleep(1)
        raise RuntimeError(f"{service} not healthy within {timeout:.0f} s")


# --- the verifying load -------------------------------------------------------------------


@dataclass
class Record:
    sent: float  # seconds since the run began
    took: float
    front: str
    engine: str
    image: str
    fresh: bool
    status: str  # HTTP status, or timeout / connection
    cache: str = ""
    lines: list[str] | None = field(default=None, repr=False)
    retry_after: str = ""


def lines_of(body: dict[str, Any]) -> list[str]:
    return [line["text"] for line in body["lines"]]


def engine_of(front: str) -> str:
    return SERVING if front == "front-serving" else PADDLE


def numbered_variant(base: str, n: int) -> bytes:
    """A new image nobody has sent, with text of its own: ``base`` above a band that reads
    ``No <n>`` (so serving one fresh image the answer of another, or of its base, is a
    difference in the lines, not an invisible one)."""
    image = Image.open(CORPUS / base).convert("RGB")
    font = ImageFont.load_default(size=28)
    band = Image.new("RGB", (max(image.width, 220), image.height + 48), "white")
    band.paste(image, (0, 0))
    ImageDraw.Draw(band).text((8, image.height + 8), f"No {n:05d}", fill="black", font=font)
    out = io.BytesIO()
    band.save(out, "PNG")
    return out.getvalue()


class Load:
    """The open-loop client: ``rate`` requests a second, a ``fresh`` share of them new images."""

    def __init__(self, stack: Stack, rate: float, fresh: float, seed: int = 1) -> None:
        self.stack = stack
        self.rate = rate
        self.fresh = fresh
        self.random = random.Random(seed)
        self.records: list[Record] = []
        self.fresh_images: dict[str, bytes] = {}
        self.hot = {name: (CORPUS / name).read_bytes() for name in HOT}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(96, thread_name_prefix="client")
        self._thread: threading.Thread | None = None
        self._counter = 0
        self.began = time.monotonic()
        self.session = requests.Session()
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=96))

    def now(self) -> float:
        return time.monotonic() - self.began

    def post(
        self, front: str, data: bytes, cache_control: str = "", timeout: float = 75
    ) -> tuple[str, dict[str, Any] | None, requests.Response | None]:
        headers = {"Cache-Control": cache_control} if cache_control else {}
        url = f"http://127.0.0.1:{self.stack.fronts[front]}/v1/ocr"
        try:
            resp = self.session.post(
                url,
                json={"image": base64.b64encode(data).decode()},
                headers=headers,
                timeout=timeout,
            )
        except requests.Timeout:
            return "timeout", None, None
        except requests.ConnectionError:
            return "connection", None, None
        except requests.RequestException as exc:  # a body cut off mid-answer, say
            return f"broken:{exc.__class__.__name__}", None, None
        status = str(resp.status_code)
        try:
            body = resp.json()
            if status == "200":
                lines_of(body)
        except (ValueError, KeyError, TypeError):
            return ("bad_body" if status == "200" else status), None, resp
        return status, body, resp

    def send(self, front: str, name: str, data: bytes, fresh: bool, timeout: float = 75) -> Record:
        sent = self.now()
        status, body, resp = self.post(front, data, timeout=timeout)
        record = Record(
            sent, round(self.now() - sent, 3), front, engine_of(front), name, fresh, status
        )
        if resp is not None:
            record.cache = resp.headers.get("X-Cache", "")
            record.retry_after = resp.headers.get("Retry-After", "")
            if status == "200" and body is not None:
                record.lines = lines_of(body)
        with self.lock:
            self.records.append(record)
        return record

    def send_later(self, front: str, name: str, data: bytes, fresh: bool) -> None:
        """``send`` on the load's client pool: it does not wait for the answer."""
        self._pool.submit(self.send, front, name, data, fresh)

    def fresh_image(self) -> tuple[str, bytes]:
        with self.lock:
            self._counter += 1
            n = self._counter
        base = FRESH_BASES[n % len(FRESH_BASES)]
        name = f"fresh-{n}-{base}"
        data = numbered_variant(base, n)
        with self.lock:
            self.fresh_images[name] = data
        return name, data

    def _tick(self) -> None:
        front = self.random.choice(list(self.stack.fronts))
        if self.random.random() < self.fresh:
            name, data = self.fresh_image()
            self.send_later(front, name, data, True)
        else:
            name = self.random.choice(HOT)
            self.send_later(front, name, self.hot[name], False)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._tick()
            next_at += 1 / self.rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)


# --- truths and verification --------------------------------------------------------------


def truths(
    load: Load, images: dict[str, bytes], pairs: list[tuple[str, str]]
) -> dict[tuple[str, str], list[str]]:
    """The lines of each (engine, image) pair, computed now and stored nowhere."""
    front_of = {PADDLE: "front", SERVING: "front-serving"}
    found: dict[tuple[str, str], list[str]] = {}

    def one(engine: str, name: str) -> None:
        for attempt in range(5):
            status, body, _ = load.post(front_of[engine], images[name], "no-cache, no-store", 120)
            if status == "200" and body is not None:
                found[(engine, name)] = lines_of(body)
                return
            time.sleep(2 + attempt * 3)
        raise RuntimeError(f"no truth for {name} from {engine}: {status}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda pair: one(*pair), pairs))
    return found


def verify(load: Load, truth: dict[tuple[str, str], list[str]]) -> list[dict[str, Any]]:
    """Every 200 answer against its engine's truth; fresh images' truths computed now."""
    fresh = {(r.engine, r.image) for r in load.records if r.fresh and r.lines is not None}
    truth.update(truths(load, load.fresh_images, sorted(fresh)))
    wrong = []
    for r in load.records:
        if r.lines is not None and r.lines != truth.get((r.engine, r.image)):
            wrong.append(
                {
                    "image": r.image,
                    "engine": r.engine,
                    "front": r.front,
                    "sent": r.sent,
                    "cache": r.cache,
                    "got": r.lines[:5],
                    "want": (truth.get((r.engine, r.image)) or [])[:5],
                }
            )
    return wrong


# --- the faults ---------------------------------------------------------------------------


def fault_worker_kill(stack: Stack, load: Load) -> str:
    pid = random.choice(stack.worker_pids("front"))
    stack.docker(
        "exec",
        stack.container("front"),
        "python",
        "-c",
        f"import os, signal; os.kill({pid}, signal.SIGKILL)",
    )
    return f"kill -9 of front worker {pid} in front"


def fault_engine_kill(stack: Stack, load: Load) -> str:
    """The engine process (tini's child in the `engine` container) killed mid-work: the
    container exits and its restart policy starts it again; the tickets it held are taken over."""
    (proc,) = [p for p in stack.processes("engine") if p["ppid"] == 1]
    restarts = stack.docker("inspect", "--format", "{{.RestartCount}}", stack.container("engine"))
    stack.docker(
        "exec",
        stack.container("engine"),
        "python",
        "-c",
        f"import os, signal; os.kill({proc['pid']}, signal.SIGKILL)",
    )
    start = time.monotonic()
    while time.monotonic() - start < 60:  # its health is the old container's until it restarts
        now = stack.docker(
            "inspect", "--format", "{{.RestartCount}}", stack.container("engine"), check=False
        )
        if now.strip() and now.strip() != restarts.strip():
            break
        time.sleep(0.5)
    took = time.monotonic() - start + stack.wait_healthy("engine")
    return f"kill -9 of the engine process {proc['pid']}; healthy again after {took:.0f} s"


def fault_front_restart(stack: Stack, load: Load) -> str:
    stack.docker("kill", stack.container("front-b"))
    time.sleep(2)
    stack.docker("start", stack.container("front-b"), check=False)  # restart policy may win
    took = stack.wait_healthy("front-b")
    return f"front-b killed (SIGKILL) and started; healthy again after {took:.0f} s"


def fault_redis_restart(stack: Stack, load: Load) -> str:
    stack.docker("restart", "--time", "1", stack.container("redis"))
    return "redis restarted (no persistence: empty)"


def fault_redis_freeze(stack: Stack, load: Load) -> str:
    stack.docker("pause", stack.container("redis"))
    time.sleep(5)
    stack.docker("unpause", stack.container("redis"))
    return "redis frozen 5 s (docker pause)"


def fault_redis_evicting(stack: Stack, load: Load, seconds: float = 20) -> str:
    """A writer fills Redis past maxmemory (the LRU evicts) while the queue's own keys (the
    stream with its group, the engines set, the ticket markers) are taken as the LRU may take
    them, every half second."""
    client = stack.redis()
    before = int(client.info("stats")["evicted_keys"])
    end, n, taken = time.monotonic() + seconds, 0, 0
    blob = os.urandom(64 * 1024)
    while time.monotonic() < end:
        pipe = client.pipeline(transaction=False)
        for _ in range(16):
            pipe.set(f"chaos:filler:{n}", blob)
            n += 1
        pipe.execute()
        if n % 128 == 0:
            queue = [k for k in client.scan_iter(match="*dispatch*", count=1000)]
            if queue:
                taken += client.unlink(*queue)
    evicted = int(client.info("stats")["evicted_keys"]) - before
    client.close()
    return f"{n} x 64 KiB written, {evicted} keys evicted by the LRU, {taken} queue keys taken"


def fault_sidecar_kill(stack: Stack, load: Load) -> str:
    stack.docker("kill", stack.container("paddle-serving"))
    time.sleep(5)
    stack.docker("start", stack.container("paddle-serving"), check=False)
    took = stack.wait_healthy("paddle-serving", 600)
    return f"sidecar killed (SIGKILL), down 5 s, healthy again after {took:.0f} s"


def fault_s3_stop(stack: Stack, load: Load) -> str:
    stack.docker("stop", "--time", "1", stack.container("s3"))
    time.sleep(20)
    stack.docker("start", stack.container("s3"))
    return "SeaweedFS stopped for 20 s, then started"


def fault_deadline_burst(stack: Stack, load: Load) -> str:
    """Distinct document pages, each seconds of engine time, whose clients give up after 1 s:
    the engines must not stay busy with, nor be slowed by, work nobody waits for. A burst
    request answered in time is checked like a fresh image; one whose client gave up is
    recorded as ``gave_up`` (the client's choice, not an error); any other answer counts."""
    start = int(load.now() * 1000)

    def one(i: int, name: str) -> None:
        key = f"burst-{start}-{i}-{name}"
        data = numbered_variant(name, start + i)
        with load.lock:
            load.fresh_images[key] = data
        record = load.send("front" if i % 2 else "front-b", key, data, True, timeout=1.0)
        if record.status == "timeout":
            record.status = "gave_up"

    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(BURST_PAGES * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"{len(threads)} document pages whose clients give up after 1 s"


FAULTS: dict[str, Callable[[Stack, Load], str]] = {
    "worker_kill": fault_worker_kill,
    "engine_kill": fault_engine_kill,
    "front_restart": fault_front_restart,
    "redis_restart": fault_redis_restart,
    "redis_freeze": fault_redis_freeze,
    "redis_evicting": fault_redis_evicting,
    "sidecar_kill": fault_sidecar_kill,
    "s3_stop": fault_s3_stop,
    "deadline_burst": fault_deadline_burst,
}
CI_FAULTS = ["worker_kill", "redis_restart", "redis_evicting"]


# --- measuring ----------------------------------------------------------------------------


def scrape(stack: Stack, engines_only: bool = False) -> dict[str, str | None]:
    """Each front's and engine's /metrics text (a front's summed over its workers), None where
    it does not answer; ``engines_only``: the engines'."""
    texts: dict[str, str | None] = {}
    services = stack.engines if engines_only else {**stack.fronts, **stack.engines}
    for service, port in services.items():
        try:
            texts[service] = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        except requests.RequestException:
            texts[service] = None
    return texts


def engine_calls(stack: Stack) -> dict[str, float]:
    """ocr_engine_calls_total{outcome="ok"} of each engine (they make every call: a front
    counts one too when it calls an engine's direct endpoint, which would count it twice);
    NaN where it does not answer."""
    return {
        engine: float("nan")
        if text is None
        else metric_sum(text, "ocr_engine_calls_total", outcome="ok")
        for engine, text in scrape(stack, engines_only=True).items()
    }


def metric(stack: Stack, name: str, **labels: str) -> float:
    """``name``{``labels``} summed over the fronts and engines that answer."""
    return sum(metric_sum(text, name, **labels) for text in scrape(stack).values() if text)


DEADLINE_SECONDS = 30  # OCR_TIMEOUT_SECONDS of the chaos stack (docker/compose.chaos.yml)
NOT_ERRORS = ("200", "gave_up")  # gave_up: a burst client's own choice


def window_report(
    records: list[Record], window: dict[str, Any], baseline_hits: float, wrong: list[dict[str, Any]]
) -> dict[str, Any]:
    """One fault's figures over the requests sent in [t0, t1); the fault began at t0 and was
    over (the container back, the pause lifted, the writer stopped) at ``applied``."""
    t0, applied, t1 = window["t0"], window["applied"], window["t1"]
    inside = [r for r in records if t0 <= r.sent < t1]
    errors = [r for r in inside if r.status not in NOT_ERRORS]
    last_error = max((r.sent + r.took for r in errors), default=applied)
    # Every image an engine was asked to compute: answered MISS or COALESCED, or a burst page
    # (computed or dropped, whether or not its client still waited).
    computed = {
        (r.engine, r.image)
        for r in inside
        if (r.status == "200" and r.cache in ("MISS", "COALESCED")) or r.image.startswith("burst")
    }
    # The hot images' hit ratio in 5 s bins from the end of the fault: back after the last bin
    # below 90 % of the baseline (None: still below at the end of the window).
    bins: dict[int, list[Record]] = collections.defaultdict(list)
    for r in inside:
        if not r.fresh and r.sent >= applied:
            bins[int((r.sent - applied) // 5)].append(r)
    ratios = {b: sum(r.cache == "HIT" for r in rs) / len(rs) for b, rs in sorted(bins.items())}
    low = [b for b, ratio in ratios.items() if ratio < 0.9 * baseline_hits]
    back = None if low and low[-1] == max(ratios) else (low[-1] + 1) * 5 if low else 0
    calls = window["calls"]
    return {
        "requests": len(inside),
        "answers_checked": sum(r.lines is not None for r in inside),
        "wrong": sum(1 for w in wrong if t0 <= w["sent"] < t1),
        "errors_by_status": dict(collections.Counter(r.status for r in errors)),
        "burst_clients_gave_up": sum(r.status == "gave_up" for r in inside),
        # A fault may cost errors, in the protocol's form with Retry-After (504: the deadline).
        "errors_without_retry_after": sum(
            r.status in ("429", "502", "503") and not r.retry_after for r in errors
        ),
        "fault_seconds": round(applied - t0, 1),
        "error_seconds_after_fault": round(max(0.0, last_error - applied), 1) if errors else 0.0,
        "hit_ratio_back_after_s": back,
        "distinct_computed": len(computed),
        "engine_calls": calls,
        "engine_calls_per_computed_image": round(calls / len(computed), 2) if computed else None,
        "p50_s": _quantile([r.took for r in inside if r.status == "200"], 0.5),
        "p99_s": _quantile([r.took for r in inside if r.status == "200"], 0.99),
        "max_s": max((r.took for r in inside if r.status != "gave_up"), default=None),
        "past_deadline": sum(r.took > DEADLINE_SECONDS + 5 for r in inside),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def hit_ratio(records: list[Record], t0: float, t1: float) -> float:
    hot = [r for r in records if t0 <= r.sent < t1 and not r.fresh and r.status == "200"]
    return sum(r.cache == "HIT" for r in hot) / len(hot) if hot else 0.0


def l3_missing(stack: Stack, load: Load) -> dict[str, Any]:
    """Each image an engine computed (answered MISS) should have its L3 object(s)."""
    import boto3

    for _ in range(60):  # the write-behind drains what it still holds
        if metric(stack, "ocr_l3_queue_depth") == 0:
            break
        time.sleep(1)
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{stack.ports['CHAOS_S3_PORT']}",
        region_name="us-east-1",
        aws_access_key_id="ocrcache",
        aws_secret_access_key=stack.s3_secret,
    )
    objects: collections.Counter[str] = collections.Counter()
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="ocr-chaos"):
            for item in page.get("Contents", []):
                parts = item["Key"].split("/")
                objects[parts[-2]] += 1  # .../{md5}/{schema}-{fingerprint}-{task}
    except s3.exceptions.NoSuchBucket:
        pass  # nothing was ever written
    import hashlib

    data = {**load.hot, **load.fresh_images}
    computed: dict[str, set[str]] = collections.defaultdict(set)
    first: dict[str, Record] = {}
    for r in load.records:
        if r.status == "200" and r.cache == "MISS" and r.image in data:
            md5 = hashlib.md5(data[r.image]).hexdigest()  # noqa: S324
            computed[md5].add(r.engine)
            first.setdefault(md5, r)
    lacking = [md5 for md5, engines in computed.items() if objects.get(md5, 0) < len(engines)]
    missing = sum(len(computed[md5]) - objects.get(md5, 0) for md5 in lacking)
    # When each missing object's image was computed, and by which front: set beside the
    # faults' times, it tells which fault lost it.
    missing_when = sorted(
        (round(first[md5].sent + first[md5].took, 1), first[md5].front) for md5 in lacking
    )
    writes = {r: metric(stack, "ocr_l3_writes_total", result=r)
              for r in ("queued", "stored", "error", "purged", "dropped")}  # fmt: skip
    depth = metric(stack, "ocr_l3_queue_depth")
    return {
        "computed_entries": sum(len(e) for e in computed.values()),
        "objects_missing": missing,
        "missing_computed_at": missing_when[:60],
        "writes": writes,
        # Each missing object was refused (queue full), failed (store down), or lost with a
        # killed worker's in-memory queue; a front restarted (its counters with it) undercounts.
        "accounted": writes["dropped"]
        + writes["error"]
        + max(
            0.0, writes["queued"] - writes["stored"] - writes["error"] - writes["purged"] - depth
        ),
    }


def processes_snapshot(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    return {service: stack.processes(service) for service in {**stack.fronts, **stack.engines}}


# --- the runs -----------------------------------------------------------------------------


@contextmanager
def engine_and_stack(ci: bool, keep: bool = False) -> Iterator[Stack]:
    started = subprocess.run(["docker", "info"], capture_output=True).returncode != 0
    subprocess.run(["bash", str(ENGINE_SCRIPT), "up"], check=True, stdout=subprocess.DEVNULL)
    if not ci:
        env = {
            **os.environ,
            "SUITE": "bullseye",
            "BASE_IMAGE": "local/debian-python:bullseye",
            "REDIS_IMAGE": "",
        }
        subprocess.run(
            ["bash", str(ENGINE_SCRIPT), "up"], check=True, env=env, stdout=subprocess.DEVNULL
        )
    stack = Stack(ci)
    try:
        stack.up()
        yield stack
    finally:
        if not keep:
            stack.down()
        if started and not keep:
            subprocess.run(["bash", str(ENGINE_SCRIPT), "down"], check=False)


class EngineCalls:
    """Engine calls since the last ``delta()``, summed over the engines; one whose counters
    restarted (its container did) counts from 0, one that does not answer keeps its last."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._last = engine_calls(stack)

    def delta(self) -> float:
        now, total = engine_calls(self._stack), 0.0
        for front, value in now.items():
            if value != value:  # NaN: not answering now
                continue
            before = self._last.get(front, 0.0)
            total += value - before if value >= before and before == before else value
            self._last[front] = value
        return total


def run_faults(
    stack: Stack,
    faults: list[str],
    random_seconds: float,
    rate: float,
    fresh: float,
    before: float = 15,
    after: float = 60,
) -> dict[str, Any]:
    engines = [PADDLE] if stack.ci else [PADDLE, SERVING]
    load = Load(stack, rate, fresh)
    began = time.time()
    truth = truths(load, load.hot, [(e, name) for e in engines for name in HOT])
    load.began = time.monotonic()
    load.start()
    windows: list[dict[str, Any]] = []
    try:
        time.sleep(before)  # the hot set is cached: the baseline
        calls = EngineCalls(stack)
        for name in faults:
            t0 = load.now()
            note = _apply(name, stack, load)
            applied = load.now()
            print(f"[chaos] {t0:7.1f} s  {name}: {note}", flush=True)
            time.sleep(after)
            windows.append({"fault": name, "what": note, "t0": t0, "applied": applied,
                            "t1": load.now(), "calls": calls.delta()})  # fmt: skip
        if random_seconds:
            rng = random.Random(7)
            t0, log = load.now(), []
            end = time.monotonic() + random_seconds
            while time.monotonic() < end:
                time.sleep(rng.uniform(10, 40))
                name = rng.choice([f for f in FAULTS if f != "sidecar_kill" or not stack.ci])
                at = load.now()
                log.append({"at": round(at, 1), "fault": name, "what": _apply(name, stack, load)})
                print(f"[chaos] {at:7.1f} s  random {name}", flush=True)
            applied = load.now()
            time.sleep(after)
            windows.append({"fault": "random", "what": log, "t0": t0, "applied": applied,
                            "t1": load.now(), "calls": calls.delta()})  # fmt: skip
    finally:
        stack.docker("unpause", stack.container("redis"), check=False)
        load.stop()
    wrong = verify(load, truth)
    baseline = hit_ratio(load.records, 5, before)
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(began)),
        "stack": "ci (front, front-b, engine, redis, s3)"
        if stack.ci
        else "front, front-b, engine, front-serving + engine-serving + paddle-serving, redis, s3",
        "rate_per_s": rate,
        "fresh_share": fresh,
        "window_seconds": after,
        "redis_maxmemory": os.environ.get("CHAOS_REDIS_MAXMEMORY", "24mb"),
        "baseline_hit_ratio": round(baseline, 3),
        "requests": len(load.records),
        "answers_checked": sum(r.lines is not None for r in load.records),
        "wrong": len(wrong),
        "wrong_examples": wrong[:10],
        "errors_outside_windows": dict(collections.Counter(
            r.status for r in load.records if r.status not in NOT_ERRORS
            and not any(w["t0"] <= r.sent < w["t1"] for w in windows))),
        "redis_evicted_keys_since_its_last_restart": int(
            stack.redis().info("stats")["evicted_keys"]
        ),
        "faults": [],
    }  # fmt: skip
    for w in windows:
        figures = window_report(load.records, w, baseline, wrong)
        report["faults"].append({"fault": w["fault"], "what": w["what"], **figures})
    report["l3"] = l3_missing(stack, load)
    report["seconds"] = round(time.time() - began)
    return report


def _apply(name: str, stack: Stack, load: Load) -> str:
    """Run one fault; one that could not be applied says so in the report (the run goes on)."""
    try:
        return FAULTS[name](stack, load)
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        return f"FAULT NOT APPLIED: {exc.__class__.__name__}: {str(exc)[:300]}"


def soak(
    stack: Stack, seconds: float, warmup: float, rate: float, fresh: float, every: float = 300
) -> dict[str, Any]:
    """The load without faults; every process's memory and open files after ``warmup`` and
    then every ``every`` seconds: the series tells a plateau from a steady growth."""
    load = Load(stack, rate, fresh)
    engines = [PADDLE] if stack.ci else [PADDLE, SERVING]
    truth = truths(load, load.hot, [(e, name) for e in engines for name in HOT])
    load.began = time.monotonic()
    load.start()
    time.sleep(warmup)
    snapshots = [processes_snapshot(stack)]
    while load.now() < seconds:
        time.sleep(min(every, max(0.0, seconds - load.now())))
        snapshots.append(processes_snapshot(stack))
    load.stop()
    wrong = verify(load, truth)
    rows = []
    for front, first in snapshots[0].items():
        for p in first:
            series = [
                next((q for q in snap[front] if q["pid"] == p["pid"]), None) for snap in snapshots
            ]
            if any(q is None for q in series):
                continue  # a process that came or went (none should)
            rss = [q["rss_kb"] for q in series if q]
            rows.append({
                "front": front, "pid": p["pid"], "argv": " ".join(p["argv"])[:60], "rss_kb": rss,
                "fds": [q["fds"] for q in series if q],
                "rss_change": round(rss[-1] / max(1, rss[0]) - 1, 4),
                # The second half's own growth: near 0 on a plateau, about half the total
                # when it grows steadily.
                "rss_change_second_half": round(rss[-1] / max(1, rss[len(rss) // 2]) - 1, 4),
            })  # fmt: skip
    return {
        "seconds": seconds,
        "warmup_seconds": warmup,
        "sample_every_seconds": every,
        "rate_per_s": rate,
        "requests": len(load.records),
        "wrong": len(wrong),
        "errors": dict(collections.Counter(r.status for r in load.records if r.status != "200")),
        "processes": rows,
        "max_rss_change": max((abs(r["rss_change"]) for r in rows), default=None),
        "flat_within_5_percent": all(abs(r["rss_change"]) <= 0.05 for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="faults", choices=["faults", "soak"])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--random", type=float, default=600, help="seconds of random faults")
    parser.add_argument("--ci", action="store_true", help="no sidecar (make test-images)")
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--fresh", type=float, default=0.2)
    parser.add_argument("--after", type=float, default=60)
    parser.add_argument("--seconds", type=float, default=3600)
    parser.add_argument("--warmup", type=float, default=300)
    parser.add_argument("--every", type=float, default=300, help="soak: seconds between samples")
    parser.add_argument("--out", default=str(RESULTS / "chaos.json"))
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if args.ci:
        faults = [f for f in faults if f != "sidecar_kill"]
    with engine_and_stack(args.ci, args.keep) as stack:
        if args.mode == "soak":
            result = {
                "soak": soak(stack, args.seconds, args.warmup, args.rate, args.fresh, args.every)
            }
        else:
            result = run_faults(stack, faults, args.random, args.rate, args.fresh, after=args.after)
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous.update(result if args.mode == "soak" else {"faults_run": result})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(previous, indent=1, default=str) + "\n")
    print(json.dumps(result, indent=1, default=str)[:6000])
    bad = result.get("wrong") or (result.get("soak") or {}).get("wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
