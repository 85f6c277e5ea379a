"""A document job's memory per page: an engine's driver renders a job's pages one at a time
(``app.pdf.pages``), so what it holds is the document and a page or two, whatever the
document's length. Measured here in a fresh process per document: resident memory before, and at its
peak while it opens a PDF and renders every page in turn (each PNG kept as long as the driver
keeps it: until the next), for PDFs of 10, 50 and 200 pages made from corpus documents,
at ``PDF_RENDER_SCALE`` 2; and each page's PNG size.

Results: bench/results/job_memory.json (``make bench-fairness`` does not run it: ``python -m
bench.job_memory``, about a minute on 2 cores).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
SCALE = 2.0


def make_pdf(pages: int) -> bytes:
    """``pages`` pages cycling the corpus's documents (as a scanner's PDF: one picture a
    page, 144 dpi, so a page renders at scale 2 to its picture's size)."""
    rows = (CORPUS / "MANIFEST.tsv").read_text().splitlines()[1:]
    names = sorted(r.split("\t")[0] for r in rows if r.split("\t")[7] == "doc")
    pictures = [Image.open(CORPUS / names[n % len(names)]).convert("RGB") for n in range(pages)]
    out = io.BytesIO()
    pictures[0].save(out, "PDF", resolution=144, save_all=True, append_images=pictures[1:])
    return out.getvalue()


def rss_mb() -> float:
    """Resident memory now (a child's ``ru_maxrss`` starts at its parent's peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(path: str) -> dict[str, float]:
    """In this process: resident memory before, and its peak while every page of the PDF is
    rendered in turn (sampled after each page), the libraries already loaded."""
    import PIL.PngImagePlugin  # noqa: F401 - loaded before the baseline, as in a driver
    import pypdfium2  # noqa: F401

    from app import pdf

    data = Path(path).read_bytes()
    before = rss_mb()
    sizes: list[int] = []
    peak = before
    started = time.perf_counter()
    with pdf.pages(data, SCALE, 100_000_000) as (count, render):
        held = b""
        for index in range(count):
            held = render(index)  # the driver holds a page until it is sent on
            sizes.append(len(held))
            peak = max(peak, rss_mb())
    return {
        "pages": count,
        "document_mb": round(len(data) / 2**20, 1),
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak, 1),
        "growth_mb": round(peak - before, 1),
        "png_mean_mb": round(sum(sizes) / len(sizes) / 2**20, 2),
        "png_max_mb": round(max(sizes) / 2**20, 2),
        "seconds_per_page": round((time.perf_counter() - started) / count, 3),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
        return
    runs = []
    for pages in (10, 50, 200):
        path = Path(f"/tmp/job-memory-{pages}.pdf")
        path.write_bytes(make_pdf(pages))
        out = subprocess.run(
            [sys.executable, "-m", "bench.job_memory", "--one", str(path)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        path.unlink()
        print(runs[-1], flush=True)
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "scale": SCALE,
        "note": "resident memory of a fresh process that opens the PDF and renders every page "
        "in turn, before and at its peak (sampled after each page); the document itself is in "
        "memory before (the driver reads it from Redis whole)",
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "job_memory.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
