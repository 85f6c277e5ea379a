"""What only an engine process runs around its engine (``python -m app engine``, and
``create_app(role="combined")``, the tests' and benchmarks' in-process service): the loop
that feeds the engine from the global miss queue, a thread per slot (``feeders``:
``Feeders``), which ticket next (``scheduler``: deficit round robin over the tenants'
lanes), who holds a ticket and how it ends (``claims``), the engines reporting in
(``heartbeat``: the live-engine register, the queue's gauges), a short page run inside a
long one's engine call (``interjection``), an idle engine's help to another queue shard
(``helping``), each feeder thread's own connection for its
blocking reads (``connections``), and the driver of document jobs (``job_driver``: pages
rendered and put through the cache). A front never imports it: ``app.cache.assembly``
imports the feeders only in a process that feeds, and ``tests/test_layers.py`` fails on any
other way to it from what a front imports.
"""
