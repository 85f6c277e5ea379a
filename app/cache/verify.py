"""Is this image the cached one, up to encoding noise? The similarity tier's check.

A perceptual hash finds candidates; it cannot tell two invoices of one template apart, nor a
page whose total changed by one digit. So nothing is served before three figures pass:

- ``aspect``: the relative difference of the aspect ratios (a 2 % crop changes it);
- ``block``: both pictures scaled to one size (grey, lightly blurred against resampling and
  JPEG noise), the largest mean absolute difference over any small window (``BLOCK`` px, a
  sliding box filter). A mean over the page hides one changed digit; a maximum does not;
- ``line``: for each line the cached result found, its box (scaled to the common size) is
  cropped from both pictures, and the largest mean difference over any character-sized
  window (as tall as the line, half as wide) is taken, relative to the line's own contrast
  (ink against paper), so grey or faint text counts as much as black. One changed
  character in a line lights up one window.

Figures are in grey levels (``block``, 0..255) and percent (``aspect``, ``line``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from app.imaging import DecodedImage
from app.vocabulary import OcrLine, OcrResult

REF_MAX_SIDE = 1600  # the reference picture kept per entry: grey, longest side at most this
BLOCK = 8  # px at the common scale
_BLUR_SIGMA = 1.0
_MIN_CONTRAST = 48.0  # grey levels


@dataclass(frozen=True)
class Figures:
    aspect: float  # percent
    block: float  # grey levels
    line: float  # percent of a character window

    def header(self) -> str:
        return f"aspect={self.aspect:.2f}%; block={self.block:.1f}; line={self.line:.1f}%"


@dataclass(frozen=True)
class Thresholds:
    aspect: float
    block: float
    line: float

    def accept(self, figures: Figures) -> bool:
        return (
            figures.aspect <= self.aspect
            and figures.block <= self.block
            and figures.line <= self.line
        )


def grey(image: DecodedImage, max_side: int = REF_MAX_SIDE) -> np.ndarray:
    """The picture the check works on: grey, the longest side at most ``max_side``."""
    import cv2  # installed with paddleocr

    g = cv2.cvtColor(image.pixels, cv2.COLOR_RGB2GRAY)
    scale = max_side / max(image.width, image.height)
    if scale < 1:
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        g = cv2.resize(g, size, interpolation=cv2.INTER_AREA)
    return g


def compare(
    request: np.ndarray,
    request_size: tuple[int, int],
    reference: np.ndarray,
    source_size: tuple[int, int],
    result: OcrResult,
    stop_above: Thresholds | None = None,
) -> Figures:
    """The three figures of ``request`` (grey, from ``grey``) against the cached
    ``reference`` of an image of ``source_size`` whose answer was ``result``.
    ``stop_above``: give up (with the figures so far) as soon as one fails."""
    import cv2

    (rw, rh), (sw, sh) = request_size, source_size
    aspect = abs((rw / rh) / (sw / sh) - 1) * 100
    inf = float("inf")
    if stop_above is not None and aspect > stop_above.aspect:
        return Figures(aspect, inf, inf)
    # One size for both: the smaller picture's width, the reference's proportions.
    cw = min(request.shape[1], reference.shape[1])
    ch = max(1, round(cw * reference.shape[0] / reference.shape[1]))
    a = _prepare(reference, (cw, ch))
    b = _prepare(request, (cw, ch))
    diff = np.abs(a - b)
    k = min(BLOCK, cw, ch)
    block = float(cv2.boxFilter(diff, -1, (k, k), normalize=True).max())
    if stop_above is not None and block > stop_above.block:
        return Figures(aspect, block, inf)
    line = 0.0
    sx, sy = cw / sw, ch / sh
    for item in result.lines:
        line = max(line, _line_figure(a, diff, item, sx, sy))
        if stop_above is not None and line > stop_above.line:
            break
    return Figures(aspect, block, line)


def _prepare(g: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    import cv2

    if (g.shape[1], g.shape[0]) != size:
        g = cv2.resize(g, size, interpolation=cv2.INTER_AREA)
    return cv2.GaussianBlur(g.astype(np.float32), (0, 0), _BLUR_SIGMA)


def _line_figure(a: np.ndarray, diff: np.ndarray, line: OcrLine, sx: float, sy: float) -> float:
    import cv2

    xs = [p[0] * sx for p in line.box]
    ys = [p[1] * sy for p in line.box]
    height, width = a.shape
    x1, x2 = max(0, int(min(xs)) - 1), min(width, int(np.ceil(max(xs))) + 1)
    y1, y2 = max(0, int(min(ys)) - 1), min(height, int(np.ceil(max(ys))) + 1)
    if x2 - x1 < 2 or y2 - y1 < 2:
        return 0.0
    ca = a[y1:y2, x1:x2]
    # Differences relative to the line's own contrast (ink against paper), so faint or grey
    # text counts as much as black; the floor keeps a blank crop's noise from growing.
    lo, hi = np.percentile(ca, (5, 95))
    contrast = max(float(hi - lo), _MIN_CONTRAST)
    rel = diff[y1:y2, x1:x2] / contrast
    # A character window: as tall as the shorter side of the box, half as wide.
    side = min(x2 - x1, y2 - y1)
    win = (max(2, side // 2), max(2, side))
    return float(cv2.boxFilter(rel, -1, win, normalize=True).max()) * 100


def rescale(result: OcrResult, width: int, height: int) -> OcrResult:
    """``result`` with its boxes in a ``width`` x ``height`` image's pixels."""
    if (result.width, result.height) == (width, height):
        return result
    fx, fy = width / result.width, height / result.height

    def point(p: tuple[int, int]) -> tuple[int, int]:
        return round(p[0] * fx), round(p[1] * fy)

    lines = tuple(
        replace(
            line,
            box=tuple(point(p) for p in line.box),  # type: ignore[arg-type]
            words=tuple(
                (text, (round(x1 * fx), round(y1 * fy), round(x2 * fx), round(y2 * fy)))
                for text, (x1, y1, x2, y2) in line.words
            ),
        )
        for line in result.lines
    )
    return replace(result, width=width, height=height, lines=lines)
