"""``ocr-cache``: the command line for people and scripts in front of a running service.

``ocr`` sends files and folders (images and PDFs) with bounded concurrency and a live progress
bar, prints a summary and optionally JSON Lines; ``warm`` pre-populates the cache; ``stats``
shows the service's figures (``GET /v1/stats``); ``purge`` drops entries through the admin API;
``queue`` shows the global miss queue (lanes, engines, the oldest wait) through the admin API;
``submit`` sends a document job and may follow it (``app/cli_jobs.py``).
Exit codes: 0 all went well, 1 some files failed (reasons on stderr), a purge is not
confirmed on every Redis replica (run it again) or a followed job did not succeed, 2 the run
could not start (bad arguments, unreachable service, refused token or document), 130
interrupted.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson
import requests
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

DEFAULT_SERVER = "http://127.0.0.1:9998"
IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pbm", ".pgm", ".ppm"}
)
PDF_SUFFIX = ".pdf"
TOKEN_ENV = ("OCR_CACHE_ADMIN_TOKEN", "ADMIN_TOKEN")
API_KEY_ENV = "OCR_CACHE_API_KEY"  # the API key of `ocr`, `warm` and `stats` (AUTH=keys)
SAVED = frozenset({"HIT", "COALESCED"})  # answers that did not call the engine


class CliError(Exception):
    """A reason the command cannot run at all: printed as one line, exit code 2."""


@dataclass
class FileResult:
    path: Path
    kind: str  # "image" or "pdf"
    seconds: float = 0.0
    cache: str = ""
    pages: int = 1
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def hit(self) -> bool:
        statuses = {s.strip() for s in self.cache.split(",") if s.strip()}
        return bool(statuses) and statuses <= SAVED

    def record(self) -> dict[str, Any]:
        """One JSON Lines record."""
        base: dict[str, Any] = {"path": str(self.path), "type": self.kind}
        if self.error is not None:
            return {**base, "error": self.error}
        return {**base, "cache": self.cache, "seconds": round(self.seconds, 4), **self.body}


class Client:
    """The service's HTTP API, with connection failures turned into one-line reasons."""

    def __init__(self, server: str, timeout: float, api_key: str | None = None) -> None:
        """``api_key``: sent as ``Authorization: Bearer`` (a service with ``AUTH=keys``)."""
        self.server = server.rstrip("/")
        self.timeout = timeout
        self._api_key = api_key
        self._local = threading.local()

    @classmethod
    def of(cls, args: argparse.Namespace) -> Client:
        return cls(args.server, args.timeout, api_key(args.api_key_file))

    @property
    def has_api_key(self) -> bool:
        return bool(self._api_key)

    @property
    def session(self) -> requests.Session:
        if not hasattr(self._local, "session"):  # one connection pool per thread
            self._local.session = requests.Session()
            if self._api_key:
                self._local.session.headers["Authorization"] = f"Bearer {self._api_key}"
        return self._local.session

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        try:
            return self.session.request(
                method, f"{self.server}{path}", timeout=self.timeout, **kwargs
            )
        except requests.ConnectionError as exc:
            raise CliError(f"cannot reach the service at {self.server}: {_reason(exc)}") from None
        except requests.Timeout:
            raise CliError(f"no answer from {self.server} within {self.timeout:g} s") from None

    def check_reachable(self) -> None:
        response = self.request("GET", "/healthz")
        if response.status_code != 200:
            raise CliError(
                f"{self.server} does not look like the OCR cache (GET /healthz answered "
                f"{response.status_code})"
            )

    def ocr(self, path: Path) -> FileResult:
        kind = "pdf" if path.suffix.lower() == PDF_SUFFIX else "image"
        result = FileResult(path, kind)
        try:
            data = path.read_bytes()
        except OSError as exc:
            result.error = f"cannot read: {exc.strerror or exc}"
            return result
        started = time.perf_counter()
        try:
            if kind == "image":
                response = self.request("POST", "/v1/ocr", files={"file": (path.name, data)})
            else:
                body = {"file": base64.b64encode(data).decode(), "fileType": 0}
                response = self.request("POST", "/ocr", json=body)
        except CliError as exc:
            result.error = str(exc)
            return result
        result.seconds = time.perf_counter() - started
        result.cache = response.headers.get("X-Cache", "")
        answer = _json(response)
        if response.status_code != 200:
            result.error = _error_reason(response.status_code, answer)
        elif kind == "image":
            keep = ("width", "height", "task", "lines", "text", "data")
            result.body = {k: answer[k] for k in keep if k in answer}
        else:
            result.body = {"pages": _pdf_pages(answer)}
            result.pages = len(result.body["pages"])
        return result


def _pdf_pages(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """PaddleX pages as the REST answer's shape: size and lines with text, score and box."""
    result = answer.get("result") or {}
    sizes = (result.get("dataInfo") or {}).get("pages") or []
    pages = []
    for size, page in zip(sizes, result.get("ocrResults") or [], strict=False):
        pruned = page.get("prunedResult") or {}
        lines = [
            {"text": text, "score": score, "box": box}
            for text, score, box in zip(
                pruned.get("rec_texts", []),
                pruned.get("rec_scores", []),
                pruned.get("rec_polys", []),
                strict=False,
            )
        ]
        pages.append({"width": size.get("width"), "height": size.get("height"), "lines": lines})
    return pages


def _json(response: requests.Response) -> dict[str, Any]:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _error_reason(status: int, body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return f"HTTP {status} {error.get('code', '')}: {error.get('message', '')}".strip()
    if body.get("errorMsg"):
        return f"HTTP {status}: {body['errorMsg']}"
    return f"HTTP {status}"


def _reason(exc: requests.ConnectionError) -> str:
    text = str(exc)
    for known in ("Connection refused", "Name or service not known", "No route to host"):
        if known in text:
            return known.lower()
    return text.splitlines()[0][:200] if text else exc.__class__.__name__


def collect(paths: Iterable[str]) -> list[Path]:
    """Images and PDFs named, or found under named folders (recursively), in a stable order."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*") if p.is_file() and _wanted(p)))
        elif path.is_file():
            found.append(path)
        else:
            raise CliError(f"no such file or folder: {raw}")
    if not found:
        raise CliError("no images or PDFs found in " + ", ".join(paths))
    return found


def _wanted(path: Path) -> bool:
    suffix = path.suffix.lower()
    return suffix in IMAGE_SUFFIXES or suffix == PDF_SUFFIX


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed and task.completed and task.elapsed:  # too few samples for rich's own
            speed = task.completed / task.elapsed
        return Text(f"{speed:.1f} files/s" if speed else "– files/s", style="progress.data.speed")


def run_files(
    client: Client, files: list[Path], concurrency: int, console: Console
) -> Iterator[FileResult]:
    """Results as they complete, with a live bar (only on a terminal)."""
    progress = Progress(
        TextColumn("[bold]OCR"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hits [green]{task.fields[hits]}[/] misses [yellow]{task.fields[misses]}[/]"
                   " errors [red]{task.fields[errors]}[/]"),
        RateColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )  # fmt: skip
    counts: dict[str, Any] = {"hits": 0, "misses": 0, "errors": 0}
    with progress, ThreadPoolExecutor(max_workers=concurrency) as pool:
        task = progress.add_task("ocr", total=len(files), **counts)
        futures = [pool.submit(client.ocr, path) for path in files]
        for future in as_completed(futures):
            result = future.result()
            key = "errors" if result.error else ("hits" if result.hit else "misses")
            counts[key] += 1
            progress.update(task, advance=1, **counts)
            yield result


def summarize(
    results: list[FileResult], elapsed: float, engine_mean: float | None, out: TextIO
) -> None:
    errors = [r for r in results if r.error]
    done = [r for r in results if not r.error]
    hits = [r for r in done if r.hit]
    misses = len(done) - len(hits)
    pdfs = [r for r in results if r.kind == "pdf"]
    what = f"{len(results)} files"
    if pdfs:
        pages = sum(r.pages for r in pdfs if not r.error)
        what += f" ({len(results) - len(pdfs)} images, {len(pdfs)} PDFs with {pages} pages)"
    rate = len(results) / elapsed if elapsed > 0 else 0.0
    print(
        f"{what}: {len(hits)} hits, {misses} misses, {len(errors)} errors "
        f"in {elapsed:.2f} s ({rate:.1f} files/s)",
        file=out,
    )
    hit_images = sum(r.pages for r in hits)
    if engine_mean is None:
        miss_times = [r.seconds / r.pages for r in done if not r.hit]
        engine_mean = sum(miss_times) / len(miss_times) if miss_times else None
        source = "this run's misses"
    else:
        source = "the service's mean engine time"
    if engine_mean is None:
        print("engine time saved by hits: unknown (the engine has not run yet)", file=out)
    else:
        print(
            f"engine time saved by hits: {hit_images * engine_mean:.2f} s "
            f"({hit_images} images x {engine_mean:.3f} s, {source})",
            file=out,
        )


def command_ocr(args: argparse.Namespace, warm: bool = False) -> int:
    client = Client.of(args)
    files = collect(args.paths)
    client.check_reachable()
    console = Console(stderr=True)
    jsonl_stdout = not warm and args.json
    summary_out = sys.stderr if jsonl_stdout else sys.stdout
    try:
        out_file = open(args.out, "wb") if not warm and args.out else None  # noqa: SIM115
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    results: list[FileResult] = []
    started = time.perf_counter()
    try:
        for result in run_files(client, files, args.concurrency, console):
            results.append(result)
            line = orjson.dumps(result.record()) + b"\n"
            if out_file is not None:
                out_file.write(line)
            if jsonl_stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
    finally:
        if out_file is not None:
            out_file.close()
    elapsed = time.perf_counter() - started
    summarize(results, elapsed, _engine_mean(client), summary_out)
    failed = [r for r in results if r.error]
    if failed:
        print(f"{len(failed)} files failed:", file=sys.stderr)
        for r in sorted(failed, key=lambda r: str(r.path)):
            print(f"  {r.path}: {r.error}", file=sys.stderr)
        return 1
    return 0


def _engine_mean(client: Client) -> float | None:
    try:
        response = client.request("GET", "/v1/stats")
    except CliError:
        return None
    if response.status_code != 200:
        return None
    mean = (_json(response).get("engine") or {}).get("mean_seconds")
    return float(mean) if isinstance(mean, int | float) else None


def command_stats(args: argparse.Namespace) -> int:
    client = Client.of(args)
    response = client.request("GET", "/v1/stats")
    if response.status_code != 200:
        raise CliError(f"GET /v1/stats answered {response.status_code}")
    stats = _json(response)
    if args.json:
        print(orjson.dumps(stats).decode())
        return 0
    cache, engine, latency = stats["cache"], stats["engine"], stats["latency"]
    redis = cache.get("redis") or {}
    ratio = cache.get("hit_ratio")
    print(
        f"hit ratio      {'–' if ratio is None else f'{ratio:.1%}'} "
        f"({cache['hits']} hits, {cache.get('coalesced', 0)} coalesced, "
        f"{cache['misses']} misses of {cache['lookups']} lookups)"
    )
    print(
        f"engine calls   {engine['calls']} ({_seconds(engine.get('mean_seconds'))} mean, "
        f"{engine.get('seconds_total', 0):.1f} s total)"
    )
    print(
        f"latency        p50 {_seconds(latency.get('p50_seconds'))}, "
        f"p95 {_seconds(latency.get('p95_seconds'))}, mean {_seconds(latency.get('mean_seconds'))}"
        f" over {latency.get('requests', 0)} requests"
    )
    if redis.get("state") == "up":
        print(
            f"entries        {redis.get('keys')} Redis keys "
            f"(L1 of the answering worker: {cache['l1']['entries']})"
        )
        limit = redis.get("maxmemory_bytes")
        print(
            f"memory         {_bytes(redis.get('used_memory_bytes'))} used of "
            f"{_bytes(limit) if limit else 'no limit'} ({redis.get('maxmemory_policy')})"
        )
        print(f"evictions      {redis.get('evicted_keys')}")
    if args.tenants:
        _print_tenants(stats.get("tenants") or {})
    else:
        print(f"redis          {redis.get('state', 'unknown')}")
    return 0


def _seconds(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: Any) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"


def _secret_file(path: str, what: str) -> str:
    """A secret kept in a file (its first line's worth, stripped)."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise CliError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if not secret:
        raise CliError(f"the {what} file {path} is empty")
    return secret


def api_key(key_file: str | None) -> str | None:
    """The API key to send: the file's, else ``OCR_CACHE_API_KEY``, else none."""
    if key_file:
        return _secret_file(key_file, "API key")
    return os.environ.get(API_KEY_ENV) or None


def admin_token(token_file: str | None) -> str:
    if token_file:
        return _secret_file(token_file, "token")
    for name in TOKEN_ENV:
        if os.environ.get(name):
            return os.environ[name]
    raise CliError(f"an admin token is needed: set {TOKEN_ENV[0]} or pass --token-file")


def command_purge(args: argparse.Namespace) -> int:
    if not (args.namespace or args.md5 or args.all):
        raise CliError(
            "say what to purge: --namespace N, --md5 H, or --all (the default namespace)"
        )
    token = admin_token(args.token_file)
    client = Client.of(args)
    body: dict[str, str] = {}
    if args.namespace:
        body["namespace"] = args.namespace
    if args.md5:
        body["md5"] = args.md5.lower()
    response = client.request(
        "POST", "/admin/purge", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    answer = _json(response)
    if response.status_code == 401:
        raise CliError(f"the service at {client.server} refused the admin token (HTTP 401)")
    # Without ADMIN_TOKEN the route does not exist: 404, or the pipeline route's POST
    # /<name>/<method> answering with its own envelope (no "removed").
    if response.status_code == 404 or (response.status_code == 200 and "removed" not in answer):
        raise CliError(f"the admin API is off at {client.server} (start it with ADMIN_TOKEN set)")
    error = answer.get("error")
    if isinstance(error, dict) and error.get("code") == "purge_unconfirmed":
        print(f"ocr-cache: purge not confirmed, run it again: {error.get('message', '')}",
              file=sys.stderr)  # fmt: skip
        return 1
    if response.status_code != 200:
        raise CliError(_error_reason(response.status_code, answer))
    what = f"md5 {answer['md5']} under " if answer.get("md5") else ""
    print(f"removed {answer['removed']} entries ({what}{answer['prefix']})")
    return 0


def command_queue(args: argparse.Namespace) -> int:
    """The global miss queue (``GET /admin/queue``): each tenant's lane, the engines and
    what each holds, the oldest wait."""
    token = admin_token(args.token_file)
    client = Client.of(args)
    response = client.request("GET", "/admin/queue", headers={"Authorization": f"Bearer {token}"})
    answer = _json(response)
    if response.status_code == 401:
        raise CliError(f"the service at {client.server} refused the admin token (HTTP 401)")
    shown = "lanes" in answer or "shards" in answer
    if response.status_code == 404 or (response.status_code == 200 and not shown):
        raise CliError(f"the admin API is off at {client.server} (start it with ADMIN_TOKEN set)")
    if response.status_code != 200:
        raise CliError(_error_reason(response.status_code, answer))
    if args.json:
        print(orjson.dumps(answer).decode())
        return 0
    for i, shard in enumerate(answer.get("shards", [answer])):  # DISPATCH_SHARDS: each one
        if i:
            print()
        print_queue(shard)
    return 0


def _ms(value: Any) -> str:
    return "–" if value is None else _seconds(value / 1000)


def print_queue(view: dict[str, Any], out: TextIO | None = None) -> None:
    """``GET /admin/queue``'s answer as tables: the lanes, then the engines and their
    tickets (``(default)``: the tenant of requests without one)."""
    out = out or sys.stdout
    engines = view.get("engines") or []
    print(
        f"{view['queue']}: {view['waiting']} waiting, {view['running']} running, oldest wait "
        f"{_ms(view.get('oldest_wait_ms'))}; engines {view['engines_live']} live, "
        f"{view['engines_busy']} busy",
        file=out,
    )
    print(file=out)
    print(f"{'tenant':<20} {'waiting':>8} {'running':>8} {'oldest wait':>12} {'deficit s':>10} "
          f"{'share':>6} {'cost s':>8}  in ring", file=out)  # fmt: skip
    for lane in view.get("lanes") or []:
        deficit, cost = lane.get("deficit_seconds"), lane.get("cost_seconds")
        print(
            f"{lane['tenant'] or '(default)':<20} {lane['waiting']:>8} {lane['running']:>8} "
            f"{_ms(lane.get('oldest_wait_ms')):>12} "
            f"{'–' if deficit is None else f'{deficit:.3f}':>10} {lane['share']:>6g} "
            f"{'–' if cost is None else f'{cost:.3f}':>8}  {'yes' if lane['in_ring'] else '-'}",
            file=out,
        )
    if not view.get("lanes"):
        print("(no lanes: nothing queued)", file=out)
    print(file=out)
    print(f"{'engine':<40} {'reported':>9} {'state':<6} {'ticket':<18} {'tenant':<20} "
          f"{'idle':>8} {'deliveries':>10}", file=out)  # fmt: skip
    for engine in engines:
        state = ("busy" if engine["running"] else "idle") if engine["live"] else "gone"
        head = f"{engine['consumer']:<40} {_ms(engine.get('last_report_ms')):>9} {state:<6}"
        holds = engine.get("holds") or []
        if not holds:
            print(f"{head} {'-' if not engine['running'] else '(not listed)'}", file=out)
        for i, held in enumerate(holds):
            lead = head if i == 0 else " " * len(head)
            note = " interjected" if held.get("interjected") else ""
            print(
                f"{lead} {held['id']:<18} {held['tenant'] or '(default)':<20} "
                f"{_ms(held['idle_ms']):>8} {held['deliveries']:>10}{note}",
                file=out,
            )
    if not engines:
        print("(no engines have reported in)", file=out)
    if view.get("truncated"):
        print("(some running tickets not listed: see --json's counts)", file=out)


def _print_tenants(tenants: dict[str, Any]) -> None:
    """Who costs what, one line per tenant (``default``: no tenant; ``other``: tenants the
    tenants file does not name)."""
    print()
    print(f"{'tenant':<16} {'hits':>8} {'misses':>8} {'engine s':>10} {'refused':>8} "
          f"{'waiting':>8}  refused by reason")  # fmt: skip
    for name, t in tenants.items():
        reasons = ", ".join(f"{k} {v}" for k, v in t.get("rejected_by_reason", {}).items())
        print(
            f"{name:<16} {t['hits'] + t.get('coalesced', 0):>8} {t['misses']:>8} "
            f"{t['engine_seconds']:>10.1f} {t['rejected']:>8} {t.get('queue_waiting', 0):>8}  "
            f"{reasons or '-'}"
        )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="ocr-cache", description="Command line for the OCR cache service."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server",
        default=os.environ.get("OCR_CACHE_SERVER", DEFAULT_SERVER),
        help=f"service URL (env OCR_CACHE_SERVER, default {DEFAULT_SERVER})",
    )
    common.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    common.add_argument(
        "--api-key-file", help=f"file holding your API key (AUTH=keys; else env {API_KEY_ENV})"
    )
    sub = top.add_subparsers(dest="command", required=True)
    ocr = sub.add_parser("ocr", parents=[common], help="recognise files and folders")
    ocr.add_argument("paths", nargs="+", metavar="PATH", help="images, PDFs or folders")
    ocr.add_argument("--concurrency", type=_positive, default=4, help="requests in flight")
    ocr.add_argument("--out", metavar="FILE", help="write JSON Lines results to FILE")
    ocr.add_argument("--json", action="store_true", help="JSON Lines on stdout (summary on stderr)")
    warm = sub.add_parser("warm", parents=[common], help="pre-populate the cache from folders")
    warm.add_argument("paths", nargs="+", metavar="DIR")
    warm.add_argument("--concurrency", type=_positive, default=4)
    stats = sub.add_parser("stats", parents=[common], help="hit ratio, engine calls, cache size")
    stats.add_argument("--json", action="store_true", help="the raw /v1/stats answer")
    stats.add_argument("--tenants", action="store_true", help="also who costs what, per tenant")
    purge = sub.add_parser("purge", parents=[common], help="drop cache entries (admin token)")
    purge.add_argument("--namespace", help="a tenant namespace")
    purge.add_argument("--md5", help="one image's entries (MD5 of its bytes)")
    purge.add_argument("--all", action="store_true", help="everything in the default namespace")
    purge.add_argument(
        "--token-file", help=f"file holding the admin token (else env {' or '.join(TOKEN_ENV)})"
    )
    queue = sub.add_parser(
        "queue", parents=[common], help="the miss queue: lanes, engines, oldest wait (admin token)"
    )
    queue.add_argument("--json", action="store_true", help="the raw /admin/queue answer")
    queue.add_argument(
        "--token-file", help=f"file holding the admin token (else env {' or '.join(TOKEN_ENV)})"
    )
    from app import cli_jobs  # it builds on this module's client

    cli_jobs.add_parser(sub, common)
    return top


def _positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "ocr":
            return command_ocr(args)
        if args.command == "warm":
            return command_ocr(args, warm=True)
        if args.command == "stats":
            return command_stats(args)
        if args.command == "queue":
            return command_queue(args)
        if args.command == "submit":
            from app import cli_jobs

            return cli_jobs.command_submit(args)
        return command_purge(args)
    except CliError as exc:
        print(f"ocr-cache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ocr-cache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # as app.cli, whose classes app/cli_jobs.py shares (CliError)
    from app.cli import main as cli_main

    sys.exit(cli_main())
