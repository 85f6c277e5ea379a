"""Everything on Cluster (issue 38 §1): every Redis structure the service uses works, through
its own HTTP API, with ``REDIS_URL`` naming one node, a Sentinel-watched master
(``redis+sentinel://``) and a Redis Cluster of 3 masters with a replica each
(``redis+cluster://``): entries (one image and several per request) and the pixel and
similarity indexes, the line store, PDF page lists, extraction field sets, the miss queue with
a lane per tenant, its ticket markers (one computation across two fronts), the tenants' quotas
and request rates, a purge, the done and purge announcements, the stats' key count. On the
cluster, where the keys lie: a namespace's entries and index keys on every master, the
queue's keys all on one (its hash tag). No Redis call of any test may fail (each structure
fails open, so a broken one would otherwise pass unseen).

Each topology starts once for the module (real ``redis-server`` processes on loopback) and
is flushed before each test; the apps are built in-process on the real engine, L1 off (every
hit is a Redis read)."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from prometheus_client import REGISTRY

from app.embedded_redis import EmbeddedRedis
from tests.conftest import SHORT, WORD_CH, WORD_EN
from tests.fleet import LoopbackCluster, loopback_sentinel, wait_for
from tests.helpers import b64, metric_sum

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOPOLOGIES = ("single", "sentinel", "cluster")
ADMIN = "cluster-structures-admin-token"
ALPHA, BETA, GAMMA = (
    "alpha-key-0123456789abcdef",
    "beta-key-0123456789abcdef",
    "gamma-key-0123456789",
)
# A loaded machine runs these beside fleets and benchmarks: a Redis answer may take longer
# than the 50 ms default without Redis being down.
REDIS_TIMEOUT_MS = 1000


@dataclass
class Topology:
    """One Redis deployment: its ``REDIS_URL`` and a plain client of each primary."""

    name: str
    url: str
    primaries: Callable[[], list[redis.Redis]]
    cluster: LoopbackCluster | None = None
    servers: list[EmbeddedRedis] = field(default_factory=list)

    def keys(self, match: str = "*") -> list[bytes]:
        return [k for c in self.primaries() for k in c.scan_iter(match, count=1000)]

    def per_primary(self, match: str) -> list[int]:
        """How many keys match ``match`` on each primary."""
        return [sum(1 for _ in c.scan_iter(match, count=1000)) for c in self.primaries()]

    def flush(self) -> None:
        for client in self.primaries():
            client.flushall()


def _single() -> Topology:
    server = EmbeddedRedis().start()
    client = redis.Redis(port=server.port)
    return Topology("single", server.url, lambda: [client], servers=[server])


def _sentinel(tmp: Path) -> Topology:
    master, replica, sentinel = loopback_sentinel(
        tmp, down_after_ms=5000, failover_timeout_ms=10000
    )
    client = redis.Redis(port=master.port)
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/ocrmaster/0"
    return Topology("sentinel", url, lambda: [client], servers=[sentinel, replica, master])


def _cluster() -> Topology:
    cluster = LoopbackCluster().start()
    clients = [cluster.client(n) for n in cluster.live_masters()]
    return Topology("cluster", cluster.url, lambda: clients, cluster=cluster)


@pytest.fixture(scope="module", params=TOPOLOGIES)
def topology(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    """Started once per module and topology (pytest groups the tests by it)."""
    name = request.param
    if name == "single":
        topo = _single()
    elif name == "sentinel":
        topo = _sentinel(tmp_path_factory.mktemp("sentinel"))
    else:
        topo = _cluster()
    try:
        yield topo
    finally:
        if topo.cluster is not None:
            topo.cluster.stop()
        for server in topo.servers:
            server.cleanup()


@pytest.fixture()
def topo(topology: Topology) -> Iterator[Topology]:
    """The topology, flushed; no Redis call of the test may fail (every structure fails open,
    so a failing one would otherwise only show as a missing hit or a missing 429)."""
    topology.flush()
    before = redis_errors()
    yield topology
    assert redis_errors() == before, "Redis calls failed (ocr_redis_errors_total)"


def redis_errors() -> dict[str, float]:
    """``ocr_redis_errors_total`` by (op, reason), from this process's registry."""
    return {
        f"{s.labels['op']} {s.labels['reason']}": s.value
        for family in REGISTRY.collect()
        if family.name == "ocr_redis_errors"
        for s in family.samples
        if s.name == "ocr_redis_errors_total" and s.value
    }


def on(make_app: Callable[..., Any], topo: Topology, **overrides: Any) -> Any:
    """An app of the real engine on ``topo``, L1 off."""
    settings = {"redis_url": topo.url, "redis_timeout_ms": REDIS_TIMEOUT_MS, "cache_l1_bytes": 0}
    return make_app(**{**settings, **overrides})


def ocr(client: Any, data: bytes, headers: dict[str, str] | None = None) -> Any:
    return client.post("/v1/ocr", json={"image": b64(data)}, headers=headers or {})


def metric(client: Any, name: str, **labels: str) -> float:
    return metric_sum(client.get("/metrics").get_data(as_text=True), name, **labels)


def variant(path: Path, n: int) -> bytes:
    """``path`` with one corner pixel changed: a fresh image (a miss), read as the original."""
    picture = Image.open(path).convert("RGB")
    picture.putpixel((0, 0), (n % 256, (n // 256) % 256, 7))
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def resaved(data: bytes) -> bytes:
    """The same pixels in other bytes: a PNG with a text chunk (what a re-save by another
    tool or a metadata change makes)."""
    picture = Image.open(io.BytesIO(data))
    info = PngInfo()
    info.add_text("Comment", "re-saved")
    out = io.BytesIO()
    picture.save(out, "PNG", pnginfo=info)
    assert out.getvalue() != data
    return out.getvalue()


def jpeg(data: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(out, "JPEG", quality=95)
    return out.getvalue()


def pdf(*paths: Path) -> bytes:
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


# Entries, the pixel index, similarity bands -----------------------------------------------


def test_entries_and_the_near_duplicate_indexes(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """MISS, then an L2 HIT (L1 off); the same pixels in other bytes: a hit from the pixel
    index; a JPEG copy: a verified hit from the similarity bands and reference picture."""
    client = on(make_app, topo, cache_similar=True).test_client()
    data = WORD_EN.read_bytes()
    first = ocr(client, data)
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    second = ocr(client, data)
    assert (second.headers["X-Cache"], second.headers["X-Cache-Tier"]) == ("HIT", "l2")
    assert second.get_json()["lines"] == first.get_json()["lines"]
    md5 = hashlib.md5(data).hexdigest()
    assert len(topo.keys(f"ocr:v1:*{{{md5}}}")) == 1  # the entry
    assert topo.keys(f"ocr:v1:*{{{md5}}}:simref")  # its reference picture
    assert topo.keys("ocr:v1:*:px2:*") and len(topo.keys("ocr:v1:*:simband:*")) == 8

    same_pixels = ocr(client, resaved(data))
    assert (same_pixels.headers["X-Cache"], same_pixels.headers["X-Cache-Tier"]) == (
        "HIT",
        "pixel",
    )
    assert same_pixels.get_json()["lines"] == first.get_json()["lines"]
    similar = ocr(client, jpeg(data))
    assert (similar.headers["X-Cache"], similar.headers["X-Cache-Tier"]) == ("HIT", "similar")
    assert similar.headers["X-Cache-Similar-Source"] == hashlib.sha256(data).hexdigest()

    # Several images in one request: one lookup for all of them (per slot on a cluster).
    several = {
        "key": ["a", "b", "c"],
        "value": [b64(data), b64(WORD_CH.read_bytes()), b64(SHORT.read_bytes())],
    }
    computed = client.post("/ocr/prediction", json=several)
    assert computed.status_code == 200 and computed.get_json()["err_no"] == 0
    again = client.post("/ocr/prediction", json=several)
    assert again.headers["X-Cache"] == "HIT"
    assert again.get_json()["value"] == computed.get_json()["value"]


# The line store -----------------------------------------------------------------------------


def test_the_line_store(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """CACHE_LINES=on: the second copy of a template reuses the first's line readings, read
    back from Redis (on the cluster, from several masters: lines carry no hash tag)."""
    from bench.templates import document

    app = on(make_app, topo, cache_lines=True)
    client = app.test_client()
    try:
        reused = metric(client, "ocr_lines_total", outcome="reused")
        faults = metric(client, "ocr_line_faults_total")  # per process: other files count too
        for copy in (0, 1):
            answer = client.post(
                "/v1/ocr", data={"file": (io.BytesIO(document("card", copy)), "card.png")}
            )
            assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"
        assert metric(client, "ocr_lines_total", outcome="reused") > reused
        assert metric(client, "ocr_line_faults_total") == faults
        spread = topo.per_primary("ocr:v1:*:line1:*")
        assert sum(spread) > 0
        if topo.cluster is not None:
            assert sum(1 for n in spread if n) > 1, spread
    finally:
        make_app()  # the shared engine's line reuse off again (the assembly's say)


# PDF page lists -----------------------------------------------------------------------------


def test_pdf_page_lists(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """A repeated PDF is answered from its page list and its pages' entries, unrendered."""
    client = on(make_app, topo, pdf_render_scale=1.0).test_client()
    payload = {"file": b64(pdf(WORD_EN, SHORT)), "fileType": 0, "visualize": False}
    rendered = metric(client, "ocr_pdf_pages_rendered_total")
    first = client.post("/ocr", data=json.dumps(payload))
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    assert metric(client, "ocr_pdf_pages_rendered_total") == rendered + 2
    assert len(topo.keys("ocr:v1:doc:*")) == 1
    second = client.post("/ocr", data=json.dumps(payload))
    assert second.status_code == 200 and second.headers["X-Cache"] == "HIT"
    assert metric(client, "ocr_pdf_pages_rendered_total") == rendered + 2  # nothing rendered
    assert second.get_json()["result"] == first.get_json()["result"]


def test_document_jobs(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """A job on every topology: its record, document, pages, the jobs stream and the
    tenant's open jobs (their own hash tags), driven to its end; a second one all hits."""
    from app.engine_side import job_driver

    app = on(make_app, topo, pdf_render_scale=1.0)
    shared = app.extensions["ocr"]
    driver = job_driver.start(shared.settings, shared.jobs, shared.cache)
    client = app.test_client()
    try:
        answers = []
        for _ in range(2):
            data = {"file": (io.BytesIO(pdf(WORD_EN, SHORT)), "doc.pdf")}
            submitted = client.post("/v1/jobs", data=data)
            assert submitted.status_code == 202, submitted.get_data(as_text=True)
            url = submitted.headers["Location"]
            deadline = time.monotonic() + 120
            while (job := client.get(url).get_json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            answers.append(job)
    finally:
        if driver is not None:
            driver.stop()
    assert [job["status"] for job in answers] == ["succeeded", "succeeded"]
    assert [p["cache"] for p in answers[1]["pages"]] == ["HIT", "HIT"]
    assert [p["lines"] for p in answers[1]["pages"]] == [p["lines"] for p in answers[0]["pages"]]
    assert len(topo.keys("ocr:job:*")) == 4  # two records and their pages; documents gone


# Extraction field sets ------------------------------------------------------------------------


def test_extraction_field_sets(base_settings, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """HunyuanOCR's extraction (a stand-in vLLM server, tests/fake_vllm.py): a request for a
    subset of an earlier extraction's fields is answered from that entry through the image's
    field-set index, without the engine."""
    from app.engines.hunyuan import HunyuanEngine
    from app.web import create_app
    from tests.conftest import CORPUS
    from tests.fake_vllm import FakeVllm
    from tests.test_hunyuan import REVISION

    fake = FakeVllm(CORPUS).start()
    try:
        settings = base_settings.with_overrides(
            redis_url=topo.url, redis_timeout_ms=REDIS_TIMEOUT_MS, ocr_engine="hunyuan",
            hunyuan_base_url=fake.url, hunyuan_model_revision=REVISION,
            hunyuan_timeout_seconds=30.0, hunyuan_startup_wait_seconds=0.0,
        )  # fmt: skip
        app = create_app(settings, engine=HunyuanEngine.from_settings(settings))
        app.testing = True
        client = app.test_client()
        wait_for(lambda: client.get("/readyz").status_code == 200, 60, "hunyuan front ready")
        data = (CORPUS / "passporteye_pass_fin.png").read_bytes()

        def extract(*fields: str) -> Any:
            return client.post(
                "/v1/ocr", json={"image": b64(data), "task": "extraction", "fields": list(fields)}
            )

        first = extract("surname", "sex")
        assert first.status_code == 200 and first.headers["X-Cache"] == "MISS", first.get_json()
        subset = extract("sex")
        assert (subset.headers["X-Cache"], subset.headers["X-Cache-Tier"]) == ("HIT", "extraction")
        assert subset.get_json()["data"] == {"sex": first.get_json()["data"]["sex"]}
        assert fake.calls == 1
        md5 = hashlib.md5(data).hexdigest()
        assert len(topo.keys(f"ocr:v1:*:extraction_index-*{{{md5}}}")) == 1
    finally:
        fake.stop()


# Tenants: lanes, quotas, rates --------------------------------------------------------------


class Gated:
    """The real engine, held at the start of each call while ``gate`` is clear."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def recognize(self, request: Any) -> Any:
        self.entered.set()
        if not self.gate.wait(120):
            raise AssertionError("the gate was never opened")
        return self._engine.recognize(request)


class Arrivals:
    """An app's requests that reached its single flight (``flights``) and its submissions to
    the queue that were answered (``submitted``): a request counted in both has joined."""

    def __init__(self, app: Any) -> None:
        self.flights = self.submitted = 0
        lock = threading.Lock()
        misses = app.extensions["ocr"]["cache"]._misses
        flights, queue = misses._flights, misses._queue
        do, submit = flights.do, queue._submit

        def counted_do(*args: Any, **kwargs: Any) -> Any:
            with lock:
                self.flights += 1
            return do(*args, **kwargs)

        def counted_submit(*args: Any, **kwargs: Any) -> Any:
            answer = submit(*args, **kwargs)
            with lock:
                self.submitted += 1
            return answer

        flights.do, queue._submit = counted_do, counted_submit


def gated_app(make_app: Callable[..., Any], topo: Topology, gated: Gated, **overrides: Any) -> Any:
    """An app on ``topo`` whose engine is ``gated``, once its feeder is in the queue."""
    app = on(make_app, topo, engine_override=gated, **overrides)
    state, cache = app.extensions["ocr"]["engine_state"], app.extensions["ocr"]["cache"]
    wait_for(lambda: state.ready, 60, "engine ready")
    assert cache.dispatch_ready(60), "the feeder never reported in"
    return app


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tenant_lanes_quotas_and_rates(make_app, engine, topo: Topology, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """AUTH=keys with three tenants: each one's misses go through its own lane of the queue
    (its stream, under the queue's hash tag: on one master); ``misses_in_flight`` refuses a
    second miss while the first is on the engine, ``engine_seconds_per_minute`` one after
    the budget was spent, ``rate`` a request past its burst (hits too): 429 each."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "alpha", "key_sha256": sha(ALPHA), "engine_seconds_per_minute": 0.01},
                    {"name": "beta", "key_sha256": sha(BETA), "rate": "0.017:2"},
                    {"name": "gamma", "key_sha256": sha(GAMMA), "misses_in_flight": 1},
                ]
            }
        )
    )
    gated = Gated(engine)
    app = gated_app(make_app, topo, gated, auth="keys", api_keys_file=str(tenants))
    client = app.test_client()
    queued = metric(client, "ocr_dispatch_tickets_total")

    # gamma: one miss held on the engine; a second one is refused meanwhile.
    gated.gate.clear()
    held: list[Any] = []
    first = threading.Thread(
        target=lambda: held.append(ocr(client, variant(SHORT, 1), bearer(GAMMA)))
    )
    first.start()
    try:
        assert gated.entered.wait(60), "the miss never reached the engine"
        lanes = topo.keys("*:jobs:gamma")
        assert len(lanes) == 1 and lanes[0].startswith(b"{ocr:dispatch:")
        assert topo.keys("ocr:quota:inflight:{gamma}")
        second = ocr(client, variant(SHORT, 2), bearer(GAMMA))
        assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    finally:
        gated.gate.set()
        first.join(120)
    assert held and held[0].status_code == 200 and held[0].headers["X-Cache"] == "MISS"
    assert ocr(client, variant(SHORT, 2), bearer(GAMMA)).status_code == 200  # its slot is free

    # alpha: its first miss spends more than its minute's engine time; the next is refused.
    spent = ocr(client, variant(WORD_EN, 1), bearer(ALPHA))
    assert spent.status_code == 200 and spent.headers["X-Cache"] == "MISS"
    refused = ocr(client, variant(WORD_EN, 2), bearer(ALPHA))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert ocr(client, variant(WORD_EN, 1), bearer(ALPHA)).headers["X-Cache"] == "HIT"
    assert topo.keys("ocr:quota:engine:{alpha}")

    # beta: a burst of 2 (three at once), then one a minute; hits count too.
    answers = [ocr(client, variant(WORD_CH, 1), bearer(BETA)) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers.get("X-Cache") for a in answers[:3]] == ["MISS", "HIT", "HIT"]
    assert topo.keys("ocr:ratelimit:{tenant:beta}")

    # Every tenant's misses went through its own lane; the queue's keys share one master.
    assert metric(client, "ocr_dispatch_tickets_total") > queued
    streams = sorted(k.rsplit(b":", 1)[1] for k in topo.keys("{ocr:dispatch:*:jobs:*"))
    assert streams == [b"alpha", b"beta", b"gamma"]
    if topo.cluster is not None:
        spread = topo.per_primary("{ocr:dispatch:*")
        assert sorted(spread)[:2] == [0, 0] and max(spread) >= 3, spread


# Ticket markers: one computation across fronts ----------------------------------------------


def test_two_fronts_compute_a_fresh_image_once(make_app, engine, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """Two apps sharing only the topology, eight threads at once asking for one fresh image,
    the engine held until every request had time to reach the queue: one engine call, one
    MISS, the rest COALESCED (the ticket marker joined the other front to the first ticket;
    a second ticket would have gone to the other front's own engine slot)."""
    gated = Gated(engine)
    apps = [gated_app(make_app, topo, gated) for _ in range(2)]
    clients = [app.test_client() for app in apps]
    arrived = [Arrivals(app) for app in apps]
    data = variant(WORD_CH, 99)
    before = metric(clients[0], "ocr_engine_calls_total")
    barrier = threading.Barrier(8)

    def one(i: int) -> tuple[int, str, Any]:
        barrier.wait(60)
        answer = ocr(clients[i % 2], data)
        return answer.status_code, answer.headers.get("X-Cache", ""), answer.get_json()

    gated.gate.clear()
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(one, i) for i in range(8)]
        try:
            assert gated.entered.wait(60), "the miss never reached the engine"

            # Every request has joined: each is in its front's single flight, and each
            # front's leader has its answer from the queue (one queued, the other joined).
            def joined() -> bool:
                flights = sum(a.flights for a in arrived)
                return flights >= 8 and all(a.submitted >= 1 for a in arrived)

            wait_for(joined, 120, "every request joined", lambda: str([vars(a) for a in arrived]))
        finally:
            gated.gate.set()
        results = [r.result(120) for r in running]
    assert metric(clients[0], "ocr_engine_calls_total") - before == 1
    assert {r[0] for r in results} == {200}
    statuses = sorted(r[1] for r in results)
    assert statuses == ["COALESCED"] * 7 + ["MISS"], statuses
    assert all(r[2]["lines"] == results[0][2]["lines"] for r in results)


# Purge, and where the keys lie --------------------------------------------------------------


def test_a_purge_reaches_every_master_and_keys_spread(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """A tenant namespace's entries and pixel index (on the cluster: ~15 images, until every
    master holds some of each), the queue's keys on one master; POST /admin/purge removes the
    namespace's keys from every master and leaves the default namespace's."""
    app = on(make_app, topo, admin_token=ADMIN, cache_tenant_header="X-Tenant")
    client = app.test_client()
    acme = {"X-Tenant": "acme"}
    default = ocr(client, WORD_EN.read_bytes())
    assert default.status_code == 200

    def spread() -> tuple[list[int], list[int]]:
        return topo.per_primary("ocr.acme:v1:*}"), topo.per_primary("ocr.acme:v1:*:px2:*")

    least, most = (15, 40) if topo.cluster is not None else (3, 3)
    sent = 0
    while sent < least or (sent < most and not all(min(s) > 0 for s in spread())):
        answer = ocr(client, variant(WORD_EN, 1000 + sent), acme)
        assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"
        sent += 1
    entries, pixels = spread()
    assert sum(entries) == sent and sum(pixels) > 0
    if topo.cluster is not None:
        assert all(entries) and all(pixels), (sent, entries, pixels)
        queue = topo.per_primary("{ocr:dispatch:*")
        assert sorted(queue)[:2] == [0, 0] and max(queue) > 0, queue
        slots = {topo.cluster.owner(k.decode()).port for k in topo.keys("{ocr:dispatch:*")}
        assert len(slots) == 1

    unauthorized = client.post("/admin/purge", json={"namespace": "acme"})
    assert unauthorized.status_code == 401
    purged = client.post(
        "/admin/purge", json={"namespace": "acme"}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert purged.status_code == 200 and purged.get_json()["removed"] >= sent
    assert topo.per_primary("ocr.acme:v1:*") == [0] * len(topo.primaries())
    # Confirmed on each master itself (a Sentinel pool's connection once dialled localhost).
    assert all(topo.per_primary("*:purgesync:*")), topo.per_primary("*:purgesync:*")
    assert ocr(client, WORD_EN.read_bytes()).headers["X-Cache"] == "HIT"  # the default's
    again = ocr(client, variant(WORD_EN, 1000), acme)
    assert again.status_code == 200 and again.headers["X-Cache"] == "MISS"


# Announcements: done and purge -------------------------------------------------------------


def test_a_computed_entry_is_announced(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """A computed entry is announced on its done channel, heard on any node (a cluster
    passes a PUBLISH to every node)."""
    client = on(make_app, topo).test_client()
    port = topo.primaries()[-1].connection_pool.connection_kwargs["port"]
    listener = redis.Redis(port=port).pubsub(ignore_subscribe_messages=True)
    try:
        listener.psubscribe("ocr:done:*")
        listener.get_message(timeout=1.0)
        assert ocr(client, variant(SHORT, 77)).headers["X-Cache"] == "MISS"
        deadline, message = time.monotonic() + 60, None
        while message is None and time.monotonic() < deadline:
            message = listener.get_message(timeout=0.5)
    finally:
        listener.close()
    assert message is not None and message["data"].startswith(b"ok:"), message


def test_a_purge_empties_every_fronts_l1(make_app, topo: Topology, request) -> None:  # type: ignore[no-untyped-def]
    """A purge through one front is announced on the purge channel, and another front that
    has only ever served hits (L2 once, then its L1) drops its L1."""
    front = on(make_app, topo, admin_token=ADMIN).test_client()
    reader_app = on(make_app, topo, cache_l1_bytes=8 << 20)
    reader_app.extensions["ocr"]["cache"].close()  # a front: its engine takes no ticket
    reader = reader_app.test_client()
    data = variant(SHORT, 78)
    assert ocr(front, data).headers["X-Cache"] == "MISS"
    assert ocr(reader, data).headers["X-Cache-Tier"] == "l2"
    assert ocr(reader, data).headers["X-Cache-Tier"] == "l1"
    l1 = reader_app.extensions["ocr"]["cache"].l1
    assert len(l1) == 1
    purged = front.post("/admin/purge", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert purged.status_code == 200 and purged.get_json()["removed"] >= 1
    wait_for(lambda: not len(l1), 60, "the reader's L1 emptied by the purge's announcement")
    assert ocr(reader, data).headers["X-Cache"] == "MISS", "the reader served its L1 after a purge"


# The stats view -----------------------------------------------------------------------------


def test_the_stats_count_every_masters_keys(make_app, topo: Topology) -> None:  # type: ignore[no-untyped-def]
    """/v1/stats says how many keys Redis holds, and /admin/stats its memory and evictions:
    on a cluster, every master's summed."""
    client = on(make_app, topo, admin_token=ADMIN).test_client()
    for n in range(3):
        assert ocr(client, variant(WORD_EN, 2000 + n)).status_code == 200
    # Keys come and go beside the request (markers, marks with a TTL): bracketed, since one
    # node's count alone (the defect) is a third of a cluster's.
    before = sum(c.dbsize() for c in topo.primaries())
    counted = client.get("/v1/stats").get_json()["cache"]["redis"]["keys"]
    after = sum(c.dbsize() for c in topo.primaries())
    assert min(before, after) - 1 <= counted <= max(before, after) + 1, (before, counted, after)
    assert counted > 0
    admin = client.get("/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).get_json()
    redis_stats = admin["redis"]
    assert redis_stats["maxmemory"] == sum(
        int(c.config_get("maxmemory")["maxmemory"]) for c in topo.primaries()
    )
    assert redis_stats["maxmemory_policy"] == "allkeys-lru"
    assert redis_stats.get("primaries", 1) == len(topo.primaries())
