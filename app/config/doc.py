"""docs/CONFIGURATION.md, generated from the sections (``python -m app config-doc``)."""

from __future__ import annotations

from typing import Any

from app.config.removed import REMOVED
from app.config.settings import SECTIONS


def markdown() -> str:
    """docs/CONFIGURATION.md: every section's settings with default, range and meaning."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from app/config/ by `python -m app config-doc`; "
        "tests/test_config.py fails when this file is stale. -->",
        "",
        "Every setting is an environment variable, read once at start-up in sections "
        "(`app/config/`, a module per section; parsers in `app/env.py`). A bad value stops "
        "start-up with one line "
        "naming the variable (`configuration error: HTTP_PORT: expected an integer, got "
        "'nope'`). `python -m app check-config` validates the environment and prints every "
        "setting (secrets as `<set>`). A *secret* may also come from the file named by "
        "`<NAME>_FILE` (Kubernetes/Docker secrets); secrets are never logged or printed. "
        "Booleans accept `1/true/yes/on` and `0/false/no/off`.",
    ]
    for name, section in SECTIONS.items():
        lines += ["", f"## {section.TITLE}", ""]
        if section.INTRO:
            lines += [section.INTRO, ""]
        lines += [f"Section `Settings.{name}` (`{section.__name__}`).", ""]
        lines += ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
        for f in section.variables():
            var = f"`{f.metadata['env']}`" + (" (*secret*)" if f.metadata["secret"] else "")
            accepted = getattr(f.metadata["parse"], "accepted", "text")
            default = _shown_default(f.default)
            lines.append(f"| {var} | {default} | {accepted} | {f.metadata['doc']} |")
    lines += ["", "## Removed", "", "Still set, these stop start-up with one line naming what "
              "replaces them.", "", "| variable | instead |", "|---|---|"]  # fmt: skip
    lines += [f"| `{var}` | {instead} |" for var, instead in REMOVED.items()]
    lines += ["", "## Read elsewhere", "", READ_ELSEWHERE]
    return "\n".join(lines) + "\n"


READ_ELSEWHERE = (
    "Not settings of the service, but read by it: the L3 store's `AWS_ENDPOINT_URL_S3` (or "
    "`AWS_ENDPOINT_URL`), `AWS_REGION` (or `AWS_DEFAULT_REGION`) and credentials (boto3's "
    "chain); `PROMETHEUS_MULTIPROC_DIR` (the metrics folder; unset: a fresh one under the "
    "temporary directory, cleaned at start); `XDG_CACHE_HOME` (the default `OCR_WORK_DIR`); "
    "`OCR_SHARED_DIR` (tests and benchmarks: where `corpus/` is); the OpenTelemetry SDK's "
    "`OTEL_*` variables (traces: on once an OTLP endpoint or `OTEL_TRACES_EXPORTER` is set, "
    "[OBSERVABILITY.md](OBSERVABILITY.md))."
)


def _shown_default(value: Any) -> str:
    if value in ("", (), None):
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`"
