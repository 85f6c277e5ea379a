"""Decode cost per hostile or worst-case input (issue 11 §3): CPU seconds and peak memory of
``app.imaging.decode_image``, each input in a fresh process so peaks do not mix.

    .venv/bin/python -m bench.decode_bounds            # writes bench/results/decode_bounds.json
    APP_ROOT=/path/to/old/checkout .venv/bin/python -m bench.decode_bounds --out before.json

``APP_ROOT`` measures another checkout's ``app.imaging`` (e.g. the commit before the fix).
The memory figure is the process's peak RSS minus its RSS after imports, i.e. what decoding
one request's image adds. The target: at most 2 CPU-s and 512 MB for any input.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "decode_bounds.json"
WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "decode-bounds-inputs"

_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
def hwm():  # peak RSS of this process image in KiB (ru_maxrss would include the parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
from app.imaging import decode_image, InvalidImage
data = open(sys.argv[1], "rb").read()
base = hwm()
start = time.process_time()
try:
    image = decode_image(data, 60_000_000)
    outcome = f"decoded {image.width}x{image.height}"
except InvalidImage as exc:
    outcome = f"refused: {type(exc).__name__}: {str(exc)[:80]}"
except Exception as exc:
    outcome = f"UNCAUGHT {type(exc).__name__}: {str(exc)[:80]}"
cpu = time.process_time() - start
peak = hwm()
print(f"{cpu:.3f} {(peak - base) / 1024:.0f} {outcome}")
"""


def _page(width: int, height: int) -> Image.Image:
    """A document-like page: white, with dark word-sized blocks (compresses like a scan)."""
    rng = np.random.default_rng(0)
    page = np.full((height, width), 255, np.uint8)
    for _ in range(20_000):
        y, x = rng.integers(0, height - 40), rng.integers(0, width - 200)
        page[y : y + int(rng.integers(10, 40)), x : x + int(rng.integers(20, 200))] = 30
    return Image.fromarray(page).convert("RGB")


def inputs() -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from tests.hostile_images import jpeg_with_scans, png_declaring

    WORK.mkdir(parents=True, exist_ok=True)
    made: dict[str, bytes] = {
        "PNG declaring 1x60,000,000": png_declaring(1, 60_000_000),
        "JPEG 3000x3000, 10,000 scans (628 KB)": jpeg_with_scans(10_000, (3000, 3000)),
        "JPEG 3000x3000, 100 scans (the most accepted)": jpeg_with_scans(100, (3000, 3000)),
    }
    page = _page(7000, 8500)  # 59.5 Mpx, just under MAX_IMAGE_PIXELS
    for label, fmt, options in [
        ("JPEG 7000x8500 baseline (59.5 Mpx)", "JPEG", {"quality": 90}),
        ("JPEG 7000x8500 progressive (59.5 Mpx)", "JPEG", {"quality": 90, "progressive": True}),
        ("PNG 7000x8500 (59.5 Mpx)", "PNG", {}),
    ]:
        buf = io.BytesIO()
        page.save(buf, fmt, **options)
        made[label] = buf.getvalue()
    paths = {}
    for n, (label, data) in enumerate(made.items()):
        path = WORK / f"input-{n}.bin"
        path.write_bytes(data)
        paths[label] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    app_root = os.environ.get("APP_ROOT", str(ROOT))
    results = []
    for label, path in inputs().items():
        line = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), app_root],
            capture_output=True, text=True, check=True, timeout=600,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        cpu, mb, outcome = line.split(" ", 2)
        row = {"input": label, "bytes": path.stat().st_size, "cpu_s": float(cpu),
               "added_peak_rss_mb": int(mb), "outcome": outcome}  # fmt: skip
        results.append(row)
        print(f"{label:48s} {row['bytes']:>11,d} B  {cpu:>7s} CPU-s  {mb:>5s} MB  {outcome}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "app_root": app_root,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )  # fmt: skip
        + "\n"
    )


if __name__ == "__main__":
    main()
