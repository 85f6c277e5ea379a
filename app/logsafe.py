"""Log lines cannot be forged: string arguments of every log record (client-supplied values
such as ``clientip``, ``logid``, paths) have their control characters escaped, so a newline
in a request field cannot start a fake log line. Installed once per process."""

from __future__ import annotations

import logging
import re
from typing import Any

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(value: str) -> str:
    """``a\\nb`` -> ``a\\\\nb``: control characters as Python escapes, the rest unchanged."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), value)


def _escaped(arg: Any) -> Any:
    if isinstance(arg, str):
        return escape(arg)
    if isinstance(arg, bytes):
        return escape(arg.decode("latin-1"))
    return arg


def install() -> None:
    """Wrap the log record factory (idempotent): escape string ``args`` of every record."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "escapes_control_characters", False):
        return

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        if isinstance(record.args, tuple):
            record.args = tuple(_escaped(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        return record

    make.escapes_control_characters = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)
