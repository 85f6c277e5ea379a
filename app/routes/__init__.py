"""The HTTP routes, one blueprint per protocol, each route parse -> cache -> render with its
protocol's error table; ``lifecycle`` is what every request goes through whatever its route.
``app.web.create_app`` only wires them: imported by fronts (and the combined role), never by
an engine process, whose small port is its own (``app/engine_process.py``)."""
