"""gunicorn settings, for running the app with gunicorn's own CLI:

    gunicorn -c gunicorn.conf.py "app.web:create_app()"

The same options `python -m app serve` uses (app/gunicorn_app.py), derived from the
environment (WEB_CONCURRENCY, WEB_THREADS, HOST, HTTP_PORT, REQUEST_TIMEOUT_SECONDS, ...):
- `gthread` workers, one per CPU core (or per GPU): each holds one OCR engine with one
  inference thread; one process per core with one thread each beats one process with two
  threads on CPU (docs/ENGINES.md: 1.01 img/s from 2 processes x 1 thread, the
  best layout for every engine measured).
- 8 threads per worker, so cache hits (about a millisecond) are served while the worker's
  engine is busy with a miss; hits are CPU-bound, so more threads add no throughput.
- no preload: engines load after fork, in each worker (a Paddle predictor must not cross a
  fork), and the worker also serves gRPC on GRPC_PORT (SO_REUSEPORT).
- Prometheus multiprocess mode: the metrics directory is cleaned when the master starts and
  dead workers are marked, so /metrics sums all workers.
"""

from app.config import Settings
from app.gunicorn_app import gunicorn_options

globals().update(gunicorn_options(Settings.from_env()))
