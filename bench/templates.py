"""Template documents for line reuse (issue 27): three layouts (an invoice, a form with
labelled fields, a membership card) rendered with Pillow and DejaVu Sans, each copy with its
own values, and the same documents "printed and re-scanned" (a small rotation and shift,
slight blur, noise), where identical crops should be rare. Deterministic per seed; shared by
``bench/lines.py`` and ``tests/test_lines.py``."""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONTS = Path("/usr/share/fonts/truetype/dejavu")
LAYOUTS = ("invoice", "form", "card")

_FIRST = ["Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
_LAST = ["Meyer", "Novak", "Okafor", "Petit", "Quinn", "Rossi", "Silva", "Tanaka", "Ueda", "Vogel"]
_ITEMS = ["Copy paper A4", "Toner cartridge", "Desk lamp", "Office chair", "USB cable",
          "Stapler", "Whiteboard", "Notebook pack", "Monitor stand", "Label printer"]  # fmt: skip
_DEPARTMENTS = ["Finance", "Logistics", "Research", "Sales", "Support", "Legal"]
_CITIES = ["Lyon", "Porto", "Graz", "Ghent", "Turin", "Bergen"]


def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(
        str(FONTS / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")), size
    )


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28):02d}.{rng.randint(1, 12):02d}.{rng.randint(2019, 2026)}"


def invoice(rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (1000, 1300), "white")
    d = ImageDraw.Draw(img)
    d.text((60, 50), "ACME Office Supplies Ltd.", font=_font(34, True), fill="black")
    for i, line in enumerate(("12 Harbour Road, Bristol BS1 4QA", "VAT Reg. GB 123 4567 89")):
        d.text((60, 100 + 30 * i), line, font=_font(20), fill="black")
    d.text((700, 50), "INVOICE", font=_font(36, True), fill="black")
    labels = ("Invoice No:", "Date:", "Customer:", "Order ref:")
    values = (
        f"INV-{rng.randint(10000, 99999)}",
        _date(rng),
        _name(rng),
        f"PO{rng.randint(1000, 9999)}",
    )
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        d.text((60, 200 + 40 * i), label, font=_font(22), fill="black")
        d.text((300, 200 + 40 * i), value, font=_font(22), fill="black")
    y = 400
    for x, head in zip(
        (60, 520, 650, 820), ("Description", "Qty", "Unit price", "Amount"), strict=True
    ):
        d.text((x, y), head, font=_font(22, True), fill="black")
    d.line((60, y + 35, 940, y + 35), fill="black", width=2)
    total = 0.0
    for row in range(rng.randint(3, 6)):
        qty, price = rng.randint(1, 20), rng.randint(150, 9900) / 100
        total += qty * price
        cells = (rng.choice(_ITEMS), str(qty), f"{price:.2f}", f"{qty * price:.2f}")
        for x, cell in zip((60, 520, 650, 820), cells, strict=True):
            d.text((x, y + 55 + 45 * row), cell, font=_font(22), fill="black")
    y = 900
    for i, (label, value) in enumerate(
        (("Subtotal", total), ("VAT 20%", total * 0.2), ("Total due", total * 1.2))
    ):
        d.text((560, y + 40 * i), label, font=_font(22, i == 2), fill="black")
        d.text((820, y + 40 * i), f"{value:.2f}", font=_font(22, i == 2), fill="black")
    d.text(
        (60, 1150), "Payment due within 30 days of the invoice date.", font=_font(20), fill="black"
    )
    d.text((60, 1185), "Thank you for your business.", font=_font(20), fill="black")
    return img


def form(rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (900, 1100), "white")
    d = ImageDraw.Draw(img)
    d.text((60, 50), "Employee Onboarding Form", font=_font(34, True), fill="black")
    d.text(
        (60, 105), "Please complete every field in block capitals.", font=_font(20), fill="black"
    )
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    fields = (
        ("Full name", f"{first} {last}".upper()),
        ("Date of birth", _date(rng)),
        ("Employee ID", f"E{rng.randint(100000, 999999)}"),
        ("Department", rng.choice(_DEPARTMENTS)),
        ("Start date", _date(rng)),
        ("Manager", _name(rng)),
        ("Office", rng.choice(_CITIES)),
        ("Desk number", f"{rng.randint(1, 9)}-{rng.randint(100, 999)}"),
    )
    for i, (label, value) in enumerate(fields):
        y = 180 + 70 * i
        d.text((60, y), f"{label}:", font=_font(24), fill="black")
        d.rectangle((330, y - 8, 840, y + 38), outline="black", width=1)
        d.text((345, y), value, font=_font(24), fill="black")
    y = 780
    for i, option in enumerate(("Laptop required", "Parking permit", "Security badge")):
        d.rectangle((60, y + 45 * i, 86, y + 26 + 45 * i), outline="black", width=2)
        if rng.random() < 0.5:
            d.line((62, y + 45 * i + 13, 84, y + 45 * i + 13), fill="black", width=3)
        d.text((100, y + 45 * i), option, font=_font(22), fill="black")
    d.text((60, 960), "Signature of employee", font=_font(20), fill="black")
    d.text((520, 960), "HR use only", font=_font(20), fill="black")
    return img


def card(rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (856, 540), (236, 242, 250))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, 856, 90), fill=(30, 60, 120))
    d.text((40, 25), "CITY LIBRARY", font=_font(36, True), fill="white")
    d.text((560, 35), "MEMBERSHIP CARD", font=_font(22, True), fill="white")
    rows = (
        ("Name", _name(rng)),
        ("Member No.", f"{rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"),
        ("Valid until", _date(rng)),
        ("Branch", rng.choice(_CITIES)),
    )
    for i, (label, value) in enumerate(rows):
        d.text((40, 140 + 80 * i), label, font=_font(22), fill=(60, 60, 60))
        d.text((300, 136 + 80 * i), value, font=_font(30, True), fill="black")
    d.text(
        (40, 480), "Not transferable. Please return if found.", font=_font(18), fill=(60, 60, 60)
    )
    return img


RENDERERS: dict[str, Callable[[random.Random], Image.Image]] = {
    "invoice": invoice,
    "form": form,
    "card": card,
}


def rescan(img: Image.Image, rng: random.Random) -> Image.Image:
    """As if printed and scanned: rotated by under half a degree, shifted a few pixels,
    slightly blurred, with sensor noise."""
    img = img.rotate(rng.uniform(-0.5, 0.5), resample=Image.Resampling.BICUBIC, fillcolor="white",
                     translate=(rng.randint(-4, 4), rng.randint(-4, 4)))  # fmt: skip
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 0.8)))
    pixels = np.asarray(img).astype(np.int16)
    noise = np.random.default_rng(rng.randint(0, 1 << 30)).normal(0, 6, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def document(layout: str, copy: int, scanned: bool = False) -> bytes:
    """PNG bytes of one copy of a layout (its values drawn from ``copy``)."""
    rng = random.Random(f"{layout}:{copy}")
    img = RENDERERS[layout](rng)
    if scanned:
        img = rescan(img, random.Random(f"{layout}:{copy}:scan"))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()
