"""The global miss queue: a front's miss becomes a ticket that the next free engine of any
worker or replica computes, fairly between tenants. Its parts, each a module:

- ``ticket``: the ticket record, its wire format and the failure markers;
- ``requester``: the front's side, ``TicketQueue`` (submit, then wait for the entry);
- ``scheduler``: which ticket next, deficit round robin over the tenants' lanes;
- ``claims``: who holds a ticket, what happens when the holder dies, how a ticket ends;
- ``heartbeat``: engines reporting in (the live-engine register) and the queue's gauges;
- ``interjection``: a short page run inside a long one's engine call;
- ``feeders``: the loop that feeds an engine, one thread per slot (``Feeders``);
- ``connections``: each feeder thread's own connection for its blocking reads.

Its Redis steps are the ``queue_*.lua`` scripts of ``app/cache/scripts/``; its keys are
``app.cache.keys.QueueKeys``.
"""
