"""An engine call made in this process, imported by every process (through the cache:
``assembly``, ``misses``, ``region``): ``compute.Computer`` (the call bounded, timed and
counted, its result stored in every tier; in a process that feeds, also the tickets its
feeders took, computed and stored the same way) on ``engine_runner.EngineRunner`` (the
calls' bounded queue, their timeout, interjected work). In a front the engine is an
``EngineProxy`` (``app/engines/direct.py``), so these run the direct path's calls to an
engine process; in an engine process, and the combined role, they run the loaded engine.
"""
