"""The OCR cache service: one package, two process roles joined by the miss queue in Redis.
A front worker (``python -m app front``: ``front_server.py``, ``web.create_front``,
``grpc_server.py``) imports the servers (``web.py``, ``routes/``, ``admin.py``, ``ui/``), the
wire formats (``protocols/``) and the shared parts; an engine process (``python -m app
engine``: ``engine_process.py``) imports ``engine_side/`` (the feeders on the queue, the jobs'
driver) and the shared parts; both import ``cache/`` (the tiers, the front door, the miss
path), ``engine_calls/`` (an engine call made in this process), ``queue/`` (the ticket, the
requester), ``engines/`` (the interface, the proxy; the configured engine, which a front
builds for its identity only), ``jobs/``, ``config/`` and the leaf modules.
``web.create_app(role="combined")`` is both roles in one process (the tests, the
benchmarks); ``python -m app serve`` (``supervisor.py``) starts the engines, then the front.
``tests/test_layers.py`` fails when anything a front imports reaches ``engine_side/``, an
engine process's own modules or an engine's runtime (Paddle, PaddleOCR).
"""
