"""Queue shards (issue 48, item 3): ``DISPATCH_SHARDS`` splits the miss queue into queues of
their own, each under a hash tag whose slot lies on its own master of a Redis Cluster, each
served by its own engines; a front sends a miss to its entry key's shard. Real parts: a
loopback cluster of 3 masters, `python -m app front` and `python -m app engine` processes on
the HunyuanOCR engine against the OpenAI-protocol stand-in (``tests/fake_vllm.py``: vLLM
cannot run here), `python -m app serve` for how it gives its engine processes their shards."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from app.cache.keys import KeySpace, shard_of, shard_tag
from app.config import ConfigError, Settings
from app.ports import free_port
from app.supervisor import Supervisor, _Engine
from bench.queue_cost import variants
from tests.conftest import CORPUS, ROOT
from tests.fake_vllm import FakeVllm, validate
from tests.fleet import Fleet, LoopbackCluster, wait_for
from tests.helpers import app_children, metric_sum

pytestmark = pytest.mark.deploy

ADMIN = "shards-admin-token-0123456789abcdef"
HUNYUAN = {
    "OCR_ENGINE": "hunyuan", "HUNYUAN_STARTUP_WAIT_SECONDS": "0",
    "HUNYUAN_MODEL_REVISION": "0123456789abcdef0123456789abcdef01234567",
    "ENGINE_WORKERS": "2", "CACHE_L1_BYTES": "0", "ADMIN_TOKEN": ADMIN,
}  # fmt: skip


def post(base: str, data: bytes) -> requests.Response:
    return requests.post(f"{base}/v1/ocr", files={"file": ("x.png", data)}, timeout=120)


def admin_queue(base: str) -> dict:
    answer = requests.get(
        f"{base}/admin/queue", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_one_shard_is_the_queue_as_it_was_and_several_spread_evenly():
    keys = KeySpace("ocr", "fp")
    assert keys.dispatch_shards("", 1) == (keys.dispatch(""),)
    shards = keys.dispatch_shards("w", 3)
    assert len({names.tag for names in shards}) == 3
    assert all(names.tag.startswith("{ocr:dispatch:v3:fp:w:s") for names in shards)
    assert shard_tag(keys.dispatch("w").tag, 2, 3) == shards[2].tag  # the same every time
    counts = [0, 0, 0]
    for i in range(3000):
        counts[shard_of(f"ocr:v1:fp:ocr:{{{i:032x}}}", 3)] += 1
    assert all(800 < count < 1200 for count in counts), counts
    assert {shard_of(f"k{i}", 1) for i in range(100)} == {0}


def test_a_shard_out_of_range_and_an_engine_without_its_shard_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="DISPATCH_SHARD"):
        Settings.from_env({"DISPATCH_SHARDS": "2", "DISPATCH_SHARD": "2"})
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(DISPATCH_SHARDS="3", OCR_WORK_DIR=str(tmp_path), ENGINE_PORT=str(free_port()))
    engine = subprocess.run([sys.executable, "-m", "app", "engine"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert engine.returncode == 2 and "DISPATCH_SHARD: required" in engine.stderr
    env.update(ENGINE_PROCESSES="2", HTTP_PORT=str(free_port()))
    serve = subprocess.run([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert serve.returncode == 2 and "DISPATCH_SHARDS=3 needs" in serve.stderr, serve.stderr


def test_a_new_engine_serves_the_least_served_shard_and_a_replacement_its_predecessors(
    monkeypatch,
):
    """``serve``'s choice (``Supervisor._next_shard``): the shard fewest engines serve; a
    retiring engine (it left its pid in the supervisor's folder before it asked) does not
    count, so its replacement, started while it still runs, serves its shard."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # it would clean it
    supervisor = Supervisor(Settings.from_env({"DISPATCH_SHARDS": "3"}), 3)
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        engines = [_Engine(1, sleepers[0], 0), _Engine(2, sleepers[1], 1)]
        supervisor._engines = list(engines)
        assert supervisor._next_shard() == 2  # the one none serves
        supervisor._engines.append(_Engine(3, sleepers[2], 2))
        assert supervisor._next_shard() == 0  # all served once: the first
        (supervisor.retiring / str(sleepers[1].pid)).touch()  # shard 1's engine retires
        assert supervisor._next_shard() == 1
        # Once it exits, reaping it forgets its note.
        sleepers[1].kill()
        sleepers[1].wait()
        supervisor._reap_engines()
        assert not any(supervisor.retiring.iterdir())
        assert supervisor._next_shard() == 1
    finally:
        supervisor._stopping = True
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        shutil.rmtree(supervisor.metrics_dir, ignore_errors=True)
        shutil.rmtree(supervisor.retiring, ignore_errors=True)


def test_three_shards_each_on_its_own_master_with_its_own_engine(tmp_path):
    fake = FakeVllm(CORPUS).start()
    calls = [0]
    lock = threading.Lock()
    original = fake.complete

    def counted(body):
        with lock:
            calls[0] += 1
        time.sleep(0.2)  # long enough for a burst of one image to meet its ticket
        return original(body)

    fake.complete = counted  # type: ignore[method-assign]
    cluster = LoopbackCluster(masters=3, replicas=0).start()
    fleet = Fleet(tmp_path, cluster.url, fronts=1, engines=3, front_workers=1,
                  HUNYUAN_BASE_URL=fake.url, DISPATCH_SHARDS="3", OCR_TIMEOUT_SECONDS="90",
                  **HUNYUAN)  # fmt: skip
    for shard, engine in enumerate(fleet.engines):
        engine.env["DISPATCH_SHARD"] = str(shard)
    try:
        fleet.start()
        base = fleet.fronts[0].base
        images = variants(30, 0)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda data: post(base, data), images))
        assert [a.status_code for a in answers] == [200] * 30, [a.text for a in answers]
        assert {a.headers["X-Cache"] for a in answers} == {"MISS"}
        # Every engine computed some: each shard's misses went to its own engine (or to an
        # idle one of another shard that helped).
        per_engine = [fleet.scrape("ocr_engine_calls_total", [engine]) for engine in fleet.engines]
        assert sum(per_engine) == 30 and all(n > 0 for n in per_engine), per_engine

        # Two slots each, once every helper has left the shard it helped.
        def settled() -> dict:
            view = admin_queue(base)
            live = [shard["engines_live"] for shard in view["shards"]]
            return view if live == [2, 2, 2] and view["running"] == 0 else {}

        view = wait_for(settled, 30, "two engines a shard, nothing running")
        assert len(view["shards"]) == 3 and view["engines_live"] == 6, view
        # Each shard's keys on a master of its own (the cluster's even split of the slots).
        tags = [shard["queue"] for shard in view["shards"]]
        owners = {cluster.owner(f"{tag}:engines").port for tag in tags}
        assert len(owners) == 3, tags
        # `ocr-cache queue`: a table per shard, each with its own engine's two slots.
        shown = subprocess.run(
            [sys.executable, "-m", "app.cli", "queue", "--server", base], cwd=ROOT,
            env={**os.environ, "OCR_CACHE_ADMIN_TOKEN": ADMIN}, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        for tag in tags:
            assert f"{tag}: 0 waiting, 0 running" in shown.stdout, shown.stdout
        assert shown.stdout.count("engines 2 live") == 3, shown.stdout

        # One image sent four times at once, from one front: still one engine call.
        before = calls[0]
        [again] = variants(1, 500)
        with ThreadPoolExecutor(4) as pool:
            burst = list(pool.map(lambda data: post(base, data), [again] * 4))
        assert [a.status_code for a in burst] == [200] * 4
        assert calls[0] - before == 1
        assert post(base, again).headers["X-Cache"] == "HIT"

        # An answer comes once the entry is stored, its ticket's finish (and a helper's leaving
        # the shard's register) just after: the gauges are read from Redis at each scrape.
        def scraped_idle() -> str:
            text = requests.get(f"{base}/metrics", timeout=10).text
            live = [metric_sum(text, "ocr_queue_shard_engines_live", shard=s) for s in "012"]
            idle = metric_sum(text, "ocr_queue_backlog", kind="misses") == 0 and live == [2] * 3
            return text if idle else ""

        text = wait_for(scraped_idle, 30, "the backlog back to 0, two engines a shard")
        for shard in range(3):
            assert f'ocr_queue_shard_backlog{{shard="{shard}"}}' in text
        assert metric_sum(text, "ocr_queue_engines_live") == 6

        # One shard's master gone (the others serving their slots meanwhile): that shard's
        # samples are missing from a scrape, the others' are still there.
        lost = cluster.owner(f"{tags[2]}:engines")
        for node in cluster.nodes:
            if node is not lost:
                cluster.client(node).config_set("cluster-require-full-coverage", "no")
        cluster.kill(lost)
        deadline = time.monotonic() + 60  # the others may answer CLUSTERDOWN for a moment
        while True:
            text = requests.get(f"{base}/metrics", timeout=30).text
            read = [metric_sum(text, "ocr_queue_shard_engines_live", shard=s) for s in "01"]
            if 'ocr_queue_shard_backlog{shard="2"}' not in text and read == [2, 2]:
                break
            assert time.monotonic() < deadline, (read, text[-1500:])
            time.sleep(1)
    finally:
        fleet.stop()
        cluster.stop()
        fake.stop()


def two_shards(tmp_path, redis_url: str, fake: FakeVllm, prefix: str, engines: int,
               **overrides: str) -> Fleet:  # fmt: skip
    """One front (one worker) and ``engines`` engine processes, engine i on shard i of two,
    against ``fake``; cache keys under ``prefix``."""
    fleet = Fleet(tmp_path, redis_url, fronts=1, engines=engines, front_workers=1,
                  HUNYUAN_BASE_URL=fake.url, DISPATCH_SHARDS="2", CACHE_KEY_PREFIX=prefix,
                  **{**HUNYUAN, **overrides})  # fmt: skip
    for shard, engine in enumerate(fleet.engines):
        engine.env["DISPATCH_SHARD"] = str(shard)
    return fleet


def test_an_idle_engine_helps_a_shard_whose_misses_wait_with_no_engine(tmp_path, redis_server):
    """Two shards, one engine process, on shard 0: shard 1's misses wait with no engine of
    their own (without help, each would get 504 at its deadline). Each asks shard 0 for help
    (its help bell), and that engine answers them. Once done, it has left shard 1's
    register: the shard has no engine again."""
    fake = FakeVllm(CORPUS).start()
    fleet = two_shards(tmp_path, redis_server.url, fake, "helpshards", 1, OCR_TIMEOUT_SECONDS="40")
    store = redis.Redis.from_url(redis_server.url)
    try:
        fleet.start()
        base = fleet.fronts[0].base
        first, *others = variants(40, 4000)
        assert post(base, first).status_code == 200
        away = shard_images(store, "helpshards", first, others, shard=1)[:3]
        home = shard_images(store, "helpshards", first, others, shard=0)[:3]
        assert len(away) == len(home) == 3
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda data: post(base, data), away + home))
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert {a.headers["X-Cache"] for a in answers} == {"MISS"}
        text = requests.get(f"{fleet.engines[0].base}/metrics", timeout=10).text
        assert metric_sum(text, "ocr_dispatch_tickets_total", outcome="helped") >= 3, text

        # The helper leaves shard 1's register once its finish is done (after the answer).
        def settled() -> bool:
            view = admin_queue(base)
            live = [shard["engines_live"] for shard in view["shards"]]
            return live == [2, 0] and view["waiting"] == 0 and view["running"] == 0

        wait_for(settled, 30, "shard 1 without an engine again", lambda: str(admin_queue(base)))
    finally:
        fleet.stop()
        fake.stop()
        store.close()


def shard_images(store: redis.Redis, prefix: str, known: bytes, candidates: list[bytes],
                 shard: int, shards: int = 2) -> list[bytes]:  # fmt: skip
    """Those of ``candidates`` whose entry keys fall in ``shard``, from the entry key of
    ``known`` (a cached image: only the MD5 differs between two images' keys)."""
    md5 = hashlib.md5(known).hexdigest()
    [key] = [k.decode() for k in store.scan_iter(f"{prefix}:*{{{md5}}}")]
    return [
        data for data in candidates
        if shard_of(key.replace(md5, hashlib.md5(data).hexdigest()), shards) == shard
    ]  # fmt: skip


def test_a_helper_killed_in_its_call_leaves_the_ticket_to_the_next_helper(tmp_path, redis_server):
    """Shard 1 has no engine; shard 0's engine, asked for help, runs shard 1's miss and is
    killed in its call. Its ticket stays shard 1's, held by a member that stops reporting
    there. The waiter's fallback check finds that holder silent and asks for help again, to
    reclaim ("1r"); shard 0's engine, restarted as a Deployment would, reclaims it and answers
    before the caller's deadline."""
    fake = FakeVllm(CORPUS).start()
    started, slow = threading.Event(), threading.Event()
    original = fake.complete

    def complete(body):
        if slow.is_set():
            slow.clear()
            started.set()
            time.sleep(8)  # the helper is killed meanwhile
        return original(body)

    fake.complete = complete  # type: ignore[method-assign]
    fleet = two_shards(tmp_path, redis_server.url, fake, "helpdies", 2,
                       OCR_TIMEOUT_SECONDS="60", DISPATCH_CHECK_SECONDS="2")  # fmt: skip
    store = redis.Redis.from_url(redis_server.url)
    try:
        fleet.start()
        base = fleet.fronts[0].base
        first, *others = variants(20, 6000)
        assert post(base, first).status_code == 200
        [image] = shard_images(store, "helpdies", first, others, shard=1)[:1]
        fleet.park_engine(1)
        wait_for(lambda: [s["engines_live"] for s in admin_queue(base)["shards"]] == [2, 0],
                 30, "shard 1 without an engine")  # fmt: skip
        slow.set()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, base, image)
            assert started.wait(30), fleet.engines[0].tail()
            assert admin_queue(base)["shards"][1]["engines_live"] == 1  # the helper, there
            fleet.engines[0].kill()  # restarted by the fleet a second later
            assert answer.result().status_code == 200, answer.result().text
        assert fleet.engines[0].starts == 2
        text = requests.get(f"{fleet.engines[0].base}/metrics", timeout=10).text
        assert metric_sum(text, "ocr_dispatch_tickets_total", outcome="reclaimed") == 1, text
        wait_for(lambda: admin_queue(base)["shards"][1]["engines_live"] == 0, 30,
                 "the restarted helper out of shard 1's register")  # fmt: skip
    finally:
        fleet.stop()
        fake.stop()
        store.close()


def test_a_long_helped_call_stays_its_helpers_beside_the_shard_s_own_engine(
    tmp_path, redis_client, redis_server
):
    """Shard 1's own engine (2 slots) busy with two long calls; a third of shard 1's misses
    asks shard 0's idle engine, whose call outlasts the live window several times over. Its
    reports in shard 1's register keep it the helper's: shard 1's engine, free again and
    sweeping, does not reclaim it, and every image is computed once."""
    fake = FakeVllm(CORPUS).start()
    seen: list[str] = []
    lock = threading.Lock()
    original = fake.complete

    def complete(body):
        images, _ = validate(body, fake.served_model)
        with lock:
            seen.append(hashlib.md5(images[0]).hexdigest())
        time.sleep(10)  # the live window is 3 s (DISPATCH_CLAIM_MS)
        return original(body)

    fleet = two_shards(tmp_path, redis_server.url, fake, "helplong", 2, OCR_TIMEOUT_SECONDS="60")
    try:
        fleet.start()
        base = fleet.fronts[0].base
        first, *others = variants(30, 8000)
        assert post(base, first).status_code == 200
        slow = shard_images(redis_client, "helplong", first, others, shard=1)[:3]
        fake.complete = complete  # type: ignore[method-assign]
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(post, base, data) for data in slow[:2]]
            wait_for(lambda: len(seen) == 2, 30, "shard 1's two slots busy")
            answers.append(pool.submit(post, base, slow[2]))
            assert [a.result().status_code for a in answers] == [200] * 3
        assert len(seen) == 3 and len(set(seen)) == 3, seen  # none computed twice
        scraped = [requests.get(f"{e.base}/metrics", timeout=10).text for e in fleet.engines]
        assert metric_sum(scraped[0], "ocr_dispatch_tickets_total", outcome="helped") == 1
        for text in scraped:
            assert metric_sum(text, "ocr_dispatch_tickets_total", outcome="reclaimed") == 0
    finally:
        fleet.stop()
        fake.stop()


def test_serve_keeps_an_engine_on_each_shard_through_retirements_and_a_crash(tmp_path):
    """``serve`` with 2 shards and 2 engine processes that retire every 3 calls
    (``ENGINE_MAX_CALLS``: each asks for its replacement, which must serve its shard, and
    leaves once it reported in), then one killed: every miss answered, each shard served
    again after each."""
    fake = FakeVllm(CORPUS).start()
    port = free_port()
    unset = ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(HUNYUAN, HTTP_PORT=str(port), HOST="127.0.0.1", GRPC_ENABLED="false",
               WEB_CONCURRENCY="1", ENGINE_PROCESSES="2", DISPATCH_SHARDS="2",
               ENGINE_MAX_CALLS="3", HUNYUAN_BASE_URL=fake.url,
               OCR_WORK_DIR=str(tmp_path / "models"), REDIS_TIMEOUT_MS="500")  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def every_shard_served() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            view = admin_queue(base)
        except (requests.RequestException, AssertionError):
            return False
        return [shard["engines_live"] for shard in view.get("shards", [])] == [2, 2]

    def tail() -> str:
        try:
            shards = [[(e["consumer"], e["live"]) for e in shard["engines"]]
                      for shard in admin_queue(base)["shards"]]  # fmt: skip
        except (requests.RequestException, AssertionError, KeyError) as exc:
            shards = [repr(exc)]
        return f"{shards}\n{log.read_text()[-3000:]}"

    try:
        wait_for(every_shard_served, 120, "an engine on each shard", tail)
        answers = [post(base, data) for data in variants(8, 1000)]
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        wait_for(lambda: "engine retiring after" in log.read_text(), 60, "a retirement", tail)
        wait_for(every_shard_served, 180, "each shard served after the retirements", tail)
        # An engine process killed: the supervisor's restart serves the shard it left.
        os.kill(app_children(proc.pid, "engine")[0], 9)
        answers = [post(base, data) for data in variants(8, 2000)]
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        wait_for(every_shard_served, 180, "each shard served after the crash", tail)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        fake.stop()
