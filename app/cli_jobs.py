"""``ocr-cache submit``: a document job (``POST /v1/jobs``) for files too long to wait on in
one request. Without ``--wait`` it prints the job's id and returns at once (the job goes on
in the service); with ``--wait`` it polls ``GET /v1/jobs/{id}`` behind a live bar of pages
and prints each page's lines. Exit codes: 0 submitted (or, waiting, the job succeeded), 1
the job failed or was cancelled, 2 it could not be submitted or followed (bad arguments,
unreachable service, a refused document), 130 interrupted while waiting (the job goes on).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from app.cli import Client, CliError, _error_reason, _json

ENDED = frozenset({"succeeded", "failed", "cancelled"})
FIRST_POLL_S = 0.5  # a short job ends within a few polls...
LAST_POLL_S = 2.0  # ...a long one is not polled more often than this
BACKOFF = 1.5
# Answers that say "not now" rather than "no": the service restarting, Redis failing over.
TRANSIENT = frozenset({429, 502, 503, 504})
GIVE_UP_S = 60.0  # how long polls may keep failing before the wait gives up


class Transient(CliError):
    """A poll that failed for now; the next one may not."""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """``submit``'s arguments, under ``ocr-cache``'s subcommands."""
    submit = sub.add_parser(
        "submit", parents=[common], help="submit a document job (a PDF or an image)"
    )
    submit.add_argument("file", metavar="FILE", help="a PDF or an image")
    submit.add_argument("--pages", help="pages to read, 1-based, e.g. 1-3,5 (default: all)")
    submit.add_argument("--callback-url", help="the service POSTs the job's end here (signed)")
    submit.add_argument("--min-score", type=_score, help="drop lines scored below this (0..1)")
    submit.add_argument(
        "--wait", action="store_true", help="follow the job to its end and print its pages"
    )
    submit.add_argument(
        "--json", action="store_true", help="the job as JSON (with --wait: the ended job)"
    )


def _score(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number in 0..1") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be a number in 0..1")
    return value


def command_submit(args: argparse.Namespace) -> int:
    client = Client.of(args)
    job = submit(client, Path(args.file), args.pages, args.callback_url, args.min_score)
    if not args.wait:
        print(orjson.dumps(job).decode() if args.json else job["id"])
        return 0
    console = Console(stderr=True)
    total = job["progress"]["pages_total"]
    print(f"job {job['id']} {job['status']} ({total} page{'' if total == 1 else 's'})",
          file=sys.stderr)  # fmt: skip
    try:
        job = wait(client, job, console)
    except KeyboardInterrupt:
        print(cancel_hint(client, job["id"]), file=sys.stderr)
        return 130
    if args.json:
        print(orjson.dumps(job).decode())
    else:
        print_job(job, sys.stdout)
    if job["status"] != "succeeded":
        error = (job.get("error") or {}).get("message") or "no reason given"
        why = "was cancelled" if job["status"] == "cancelled" else f"failed: {error}"
        print(f"ocr-cache: job {job['id']} {why}", file=sys.stderr)
        return 1
    return 0


def submit(
    client: Client, path: Path, pages: str | None, callback_url: str | None, min_score: float | None
) -> dict[str, Any]:
    """The job as the service accepted it; a refusal is the service's reason (exit 2)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    form: dict[str, str] = {}
    if pages:
        form["pages"] = pages
    if callback_url:
        form["callback_url"] = callback_url
    if min_score is not None:
        form["min_score"] = repr(min_score)
    response = client.request("POST", "/v1/jobs", files={"file": (path.name, data)}, data=form)
    answer = _json(response)
    if response.status_code != 202:
        raise CliError(f"{path} was not accepted: {_error_reason(response.status_code, answer)}")
    if not isinstance(answer.get("id"), str) or "progress" not in answer:
        raise CliError(f"{client.server} answered POST /v1/jobs without a job")
    return answer


def get_job(client: Client, job_id: str) -> dict[str, Any]:
    """The job now; ``Transient`` when it could not be read for a reason that may pass."""
    try:
        response = client.request("GET", f"/v1/jobs/{job_id}")
    except CliError as exc:  # unreachable or no answer in time: perhaps restarting
        raise Transient(str(exc)) from None
    answer = _json(response)
    if response.status_code in TRANSIENT:
        raise Transient(_error_reason(response.status_code, answer))
    if response.status_code != 200:
        raise CliError(f"job {job_id}: {_error_reason(response.status_code, answer)}")
    if answer.get("status") not in ENDED | {"queued", "running"}:
        raise CliError(f"{client.server} answered GET /v1/jobs/{job_id} without a job")
    return answer


def wait(client: Client, job: dict[str, Any], console: Console) -> dict[str, Any]:
    """Poll until the job ends (backing off from ``FIRST_POLL_S`` to ``LAST_POLL_S``), with
    a live bar of its pages (only on a terminal)."""
    progress = Progress(
        TextColumn("[bold]job"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("pages  failed [red]{task.fields[failed]}[/]  {task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    interval, failing_since = FIRST_POLL_S, None
    with progress:
        counts = job["progress"]
        task = progress.add_task("job", total=counts["pages_total"], failed=0, status=job["status"])
        while job["status"] not in ENDED:
            time.sleep(interval)
            interval = min(interval * BACKOFF, LAST_POLL_S)
            try:
                job = get_job(client, job["id"])
            except Transient as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > GIVE_UP_S:
                    raise CliError(
                        f"job {job['id']} could not be read for {GIVE_UP_S:g} s ({exc}); it "
                        f"may go on in the service: GET /v1/jobs/{job['id']}"
                    ) from None
                continue
            failing_since = None
            counts = job["progress"]
            progress.update(
                task,
                completed=counts["pages_done"] + counts["pages_failed"],
                failed=counts["pages_failed"],
                status=job["status"],
            )
    return job


def cancel_hint(client: Client, job_id: str) -> str:
    """What Ctrl-C says: the job was not cancelled, and how to cancel it."""
    auth = ' -H "Authorization: Bearer <your API key>"' if client.has_api_key else ""
    return (
        f"ocr-cache: stopped waiting; job {job_id} goes on in the service. To cancel it: "
        f"DELETE /v1/jobs/{job_id}, e.g.\n  curl -X DELETE{auth} {client.server}/v1/jobs/{job_id}"
    )


def print_job(job: dict[str, Any], out: TextIO) -> None:
    """The ended job for people: a summary line, then each page's cache status and lines
    (or its error); why a job did not succeed goes to stderr (``command_submit``)."""
    counts = job["progress"]
    took = _elapsed(job.get("created_at"), job.get("finished_at"))
    print(
        f"job {job['id']} {job['status']}: {counts['pages_done']} of {counts['pages_total']} "
        f"pages done, {counts['pages_failed']} failed{f' in {took:.1f} s' if took else ''}",
        file=out,
    )
    for page in job.get("pages") or []:
        error = page.get("error")
        if error:
            print(f"page {page['page']}: error {error.get('code')}: {error.get('message')}",
                  file=out)  # fmt: skip
            continue
        lines = page.get("lines") or []
        count = f"{len(lines)} line{'' if len(lines) == 1 else 's'}"
        print(f"page {page['page']}: {page.get('cache') or '-'}, {count}", file=out)
        for line in lines:
            print(f"  {line['text']}", file=out)


def _elapsed(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return None
