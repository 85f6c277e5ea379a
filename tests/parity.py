"""Comparing our ``/ocr`` answers with PaddleX's own basic-serving app (tests/paddlex_reference.py).

Whole answers are compared, except ``logId`` (fresh per request on both sides) and the bytes
of the JPEG pictures: those are compared as ``Picture`` says (format, size, close pixels).
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import requests
from PIL import Image

from app.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
IMAGE_FIELDS = ("ocrImage", "inputImage", "docPreprocessingImage")


@contextmanager
def reference_server(work_dir: Path, log_path: Path, wait_s: float = 900) -> Iterator[str]:
    """Start PaddleX's app on a free port; yields its base URL; stops it on exit."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "paddlex_reference.py"), str(port),
             str(work_dir)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"PaddleX reference server exited: {tail}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("PaddleX reference server did not start in time")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Picture:
    """A returned JPEG, equal to another when format and size agree and the pixels are close.

    ``inputImage`` is compared whole; ``ocrImage`` by its left half (the page with the boxes
    filled in): upstream's right half, the text panel, stays blank here because its
    visualisation downloads a font, which fails offline. Two encoders and resizers never agree
    on bytes, so pixels are compared by mean absolute difference (0 to 255).
    """

    TOLERANCE = 0.5  # measured: 0.0 on every corpus image

    def __init__(self, key: str, text: str) -> None:
        image = Image.open(io.BytesIO(base64.b64decode(text)))
        self.key, self.format, self.size = key, image.format, image.size
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
        self.pixels = pixels[:, : image.width // 2] if key == "ocrImage" else pixels

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Picture) or (self.key, self.format, self.size) != (
            other.key, other.format, other.size,
        ):  # fmt: skip
            return False
        return float(np.abs(self.pixels - other.pixels).mean()) <= self.TOLERANCE

    def __repr__(self) -> str:
        return f"Picture({self.key}, {self.format}, {self.size})"


def comparable(status: int, body: Any) -> Any:
    """The answer as compared: status and body, without logId, pictures described."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                key: Picture(key, item) if key in IMAGE_FIELDS and item else walk(item)
                for key, item in value.items()
                if key != "logId"
            }
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return {"status": status, "body": walk(body)}


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Paths where the two differ (first 20), for a readable failure."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        if list(ours) != list(theirs):
            found.append(f"{path}: keys {list(ours)} != {list(theirs)}")
        for key in ours.keys() & theirs.keys():
            found += differences(ours[key], theirs[key], f"{path}.{key}")
        return found[:20]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        found = []
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            found += differences(a, b, f"{path}[{i}]")
        return found[:20]
    if ours != theirs or type(ours) is not type(theirs):
        return [f"{path}: ours {ours!r:.200} != upstream {theirs!r:.200}"]
    return []
