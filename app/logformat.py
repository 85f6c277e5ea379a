"""The service's own log lines: text (the default) or ``LOG_FORMAT=json``, one JSON object a
line as the edge's access log is, for log collectors that parse rather than grep. A JSON line
written inside a traced request carries its ``trace_id`` and ``span_id`` (``app.tracing``),
so a trace viewer and the logs find each other."""

from __future__ import annotations

import logging
import time

import orjson

from app import tracing

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One object a line: time, level, logger, message, process, thread; the current span's
    ids when there is one; the traceback as ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        trace_id, span_id = tracing.TRACER.ids()
        if trace_id:
            line["trace_id"], line["span_id"] = trace_id, span_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return orjson.dumps(line).decode()


def configure(level: str, fmt: str = "text") -> None:
    """The root logger's one handler (stderr), in ``fmt`` (``LOG_FORMAT``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
