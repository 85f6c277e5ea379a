"""The global miss queue as both roles share it, imported by fronts and engine processes: a
front's miss becomes a ticket (``ticket``: the record, its wire format, the failure markers,
the doorbells' waits) that the front submits and waits for (``requester``: ``TicketQueue``,
which an engine process's job driver uses too, for its pages; ``watch``: the waiters'
fallback check, one per lane; ``asks``: with shards, a miss behind busy engines asks
another shard's), computed by the next free engine of any worker or replica, fairly between
tenants; ``inspect`` reads the queue's picture in one script (``/admin/queue``,
``ocr-cache queue``, the engines' gauges). What takes and serves tickets (the scheduler,
claims, heartbeat, interjection, the feeders) runs in engine processes only:
``app/engine_side/``. The queue's Redis steps are the ``queue_*.lua`` scripts of
``app/cache/scripts/``; its keys are ``app.cache.keys.QueueKeys``.
"""
