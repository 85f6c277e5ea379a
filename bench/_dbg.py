import tempfile, time
from pathlib import Path
from bench.queue_cost import queue_fleet, variants, post, SHARED, Masters, warm
from tests.fake_vllm import FakeVllm, Recording, answer
from tests.fleet import LoopbackCluster
fake = FakeVllm(SHARED / "corpus").start()
with tempfile.TemporaryDirectory() as tmp:
    cluster = LoopbackCluster(masters=3, replicas=0).start()
    fleet = queue_fleet(Path(tmp), cluster, fake.url)
    try:
        masters = Masters(cluster)
        base = warm(fleet, masters)
        def stats():
            return {p: {k: v["calls"] for k, v in c.info("commandstats").items()} for p, c in masters.clients.items()}
        a = stats(); time.sleep(20); b = stats()
        for p in b:
            print(p, "queue" if p == masters.queue else "", {k: b[p][k] - a[p].get(k, 0) for k in b[p] if b[p][k] - a[p].get(k, 0)})
    finally:
        fleet.stop(); cluster.stop()
