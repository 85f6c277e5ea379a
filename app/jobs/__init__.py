"""Asynchronous document jobs, imported by fronts and engine processes: a job in Redis
(``store``: a front checks and stores a job and answers its status; an engine process reads
its document and records its pages) and the job-end callback (``callback``: a front checks
its URL, an engine process signs and sends it). The driver that renders a job's pages and
puts them through the cache runs in engine processes only: ``app/engine_side/job_driver.py``.
"""
