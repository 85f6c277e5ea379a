"""gunicorn settings, for running the app with gunicorn's own CLI:

    gunicorn -c gunicorn.conf.py "app.web:create_app()"

The same options `python -m app serve` uses (app/gunicorn_app.py), derived from the
environment (WEB_CONCURRENCY, WEB_THREADS, HOST, HTTP_PORT, REQUEST_TIMEOUT_SECONDS, ...):
- `gthread` workers holding no engine (their misses go to the engine processes): of the
  worker models gunicorn ships, the one that serves hits while misses wait and keeps gRPC
  in the same workers (sync: one request per process; gevent: dearer hits here and no
  grpcio; measured in docs/PERFORMANCE.md, "Roles apart").
- 32 threads per worker (WEB_THREADS): a thread waits for each miss in flight, so there
  must be more threads than misses a worker may have waiting for hits never to queue
  behind them; the thread count costs hits nothing (measured from 1 to 32).
- no preload: each worker also serves gRPC on GRPC_PORT (SO_REUSEPORT), whose threads
  must start after the fork.
- Prometheus multiprocess mode: the metrics directory is cleaned when the master starts and
  dead workers are marked, so /metrics sums all workers.
"""

from app.config import Settings
from app.gunicorn_app import gunicorn_options

globals().update(gunicorn_options(Settings.from_env()))
