"""The cache, imported by every process: keys, the value codec, the tiers (L1, L2 in Redis
with its circuit breaker, L3, pixel, similar, extraction subsets), the front door
(``region.OcrCache``; read it like dogpile.cache: ``get_or_compute`` is the one entry
point), the miss path (``misses``), the tenants' quotas, and the one place it is put
together (``assembly``). A front looks its requests up here and queues its misses; an engine
process stores its results through the same tiers. The engine call behind a miss is
``app/engine_calls/``; the feeders that serve queued misses are ``app/engine_side/``, which
``assembly`` imports only in a process that feeds (an engine process, the combined role).
Every Lua script of the service, whichever process sends it, is in ``scripts/``.
"""
