"""Template documents for line reuse (issue 27): three layouts (an invoice, a form with
labelled fields, a membership card) rendered with Pillow and DejaVu Sans, each copy with its
own values, and the same documents "printed and re-scanned" (a small rotation and shift,
slight blur, noise), where identical crops should be rare. Deterministic per seed; shared by
``bench/lines.py`` and ``tests/test_lines.py``.

The values are another copy's only where a real set would repeat them too: names, items,
departments, places and dates are drawn without repeats across the first ``DISTINCT_COPIES``
copies (each field from its own permutation of a pool large enough), numbers at random
(invoice and member numbers, prices; a quantity of 3 appears in many invoices, as it does)."""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONTS = Path("/usr/share/fonts/truetype/dejavu")
LAYOUTS = ("invoice", "form", "card")

DISTINCT_COPIES = 24  # copies whose names, items, places and dates never repeat

_FIRST = ["Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
          "Karin", "Liam", "Maya", "Noah", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Umar",
          "Vera", "Wim", "Xenia", "Yusuf", "Zoe", "Aron", "Bianca", "Carlos", "Dora", "Emil",
          "Fiona", "Goran", "Hanna", "Ivan", "Julia", "Kenji", "Lena", "Marco", "Nina", "Oskar",
          "Petra", "Rafael", "Sofia", "Tomas", "Ulla", "Viktor", "Wanda", "Yara"]  # fmt: skip
_LAST = ["Meyer", "Novak", "Okafor", "Petit", "Quinn", "Rossi", "Silva", "Tanaka", "Ueda",
         "Vogel", "Weber", "Young", "Zimmer", "Adler", "Berg", "Costa", "Dahl", "Ekman", "Fischer",
         "Garcia", "Horvat", "Ito", "Jensen", "Kowalski", "Lang", "Moreau", "Nagy", "Olsen",
         "Perez", "Richter", "Santos", "Torres", "Urban", "Varga", "Wolf", "Yilmaz", "Zeller",
         "Bauer", "Conti", "Dubois", "Engel", "Fuchs", "Greco", "Hansen", "Ivanova", "Keller",
         "Lorenz", "Marino"]  # fmt: skip
_ADJECTIVES = ["Copy", "Recycled", "Premium", "Compact", "Wireless", "Steel", "Glass",
               "Standing", "Ergonomic", "Magnetic", "Portable", "Heavy duty"]  # fmt: skip
_NOUNS = ["paper A4", "toner cartridge", "desk lamp", "office chair", "USB cable", "stapler",
          "whiteboard", "notebook pack", "monitor stand", "label printer", "filing cabinet",
          "keyboard"]  # fmt: skip
_ITEMS = [f"{adjective} {noun}" for adjective in _ADJECTIVES for noun in _NOUNS]
_DEPARTMENTS = ["Finance", "Logistics", "Research", "Sales", "Support", "Legal", "Marketing",
                "Purchasing", "Facilities", "Security", "Training", "Quality", "Payroll",
                "Engineering", "Design", "Operations", "Compliance", "Audit", "Treasury",
                "Procurement", "Recruiting", "Customer care", "IT services",
                "Planning"]  # fmt: skip
_CITIES = ["Lyon", "Porto", "Graz", "Ghent", "Turin", "Bergen", "Malmo", "Krakow", "Seville",
           "Leipzig", "Utrecht", "Aarhus", "Brno", "Split", "Tartu", "Cork", "Basel", "Namur",
           "Verona", "Bilbao", "Tampere", "Lille", "Szeged", "Kaunas", "Bremen", "Nantes",
           "Genoa", "Varna", "Plovdiv", "Linz", "Trieste", "Odense", "Gdansk", "Riga", "Espoo",
           "Braga", "Bologna", "Dijon", "Toulouse", "Zagreb", "Kosice", "Ljubljana", "Salzburg",
           "Aachen", "Uppsala", "Tromso", "Galway", "Coimbra"]  # fmt: skip


def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(
        str(FONTS / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")), size
    )


class _Values:
    """One copy's values: each field takes the ``copy``-th value of its own fixed
    permutation of a pool (``slots`` values a copy), so no copy repeats another's within
    ``DISTINCT_COPIES``; numbers from ``rng``."""

    def __init__(self, layout: str, copy: int, rng: random.Random) -> None:
        self._layout, self._copy, self.rng = layout, copy, rng

    def pick(self, field: str, pool: list[str], slot: int = 0, slots: int = 1) -> str:
        order = random.Random(f"{self._layout}:{field}").sample(pool, len(pool))
        return order[(self._copy * slots + slot) % len(order)]

    def name(self, field: str) -> str:
        return f"{self.pick(field + ':first', _FIRST)} {self.pick(field + ':last', _LAST)}"

    def date(self, field: str) -> str:
        """A date of its own: 53 days apart from copy to copy (about 3.5 years over 24)."""
        salt = random.Random(f"{self._layout}:{field}").randint(0, 3000)
        day = _EPOCH + timedelta(days=salt + 53 * self._copy)
        return day.strftime("%d.%m.%Y")


_EPOCH = date(2016, 1, 1)


def invoice(v: _Values) -> Image.Image:
    rng = v.rng
    img = Image.new("RGB", (1000, 1300), "white")
    d = ImageDraw.Draw(img)
    d.text((60, 50), "ACME Office Supplies Ltd.", font=_font(34, True), fill="black")
    for i, line in enumerate(("12 Harbour Road, Bristol BS1 4QA", "VAT Reg. GB 123 4567 89")):
        d.text((60, 100 + 30 * i), line, font=_font(20), fill="black")
    d.text((700, 50), "INVOICE", font=_font(36, True), fill="black")
    labels = ("Invoice No:", "Date:", "Customer:", "Order ref:")
    values = (
        f"INV-{rng.randint(10000, 99999)}",
        v.date("date"),
        v.name("customer"),
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
        item = v.pick("item", _ITEMS, row, 6)
        cells = (item, str(qty), f"{price:.2f}", f"{qty * price:.2f}")
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


def form(v: _Values) -> Image.Image:
    rng = v.rng
    img = Image.new("RGB", (900, 1100), "white")
    d = ImageDraw.Draw(img)
    d.text((60, 50), "Employee Onboarding Form", font=_font(34, True), fill="black")
    d.text(
        (60, 105), "Please complete every field in block capitals.", font=_font(20), fill="black"
    )
    fields = (
        ("Full name", v.name("employee").upper()),
        ("Date of birth", v.date("birth")),
        ("Employee ID", f"E{rng.randint(100000, 999999)}"),
        ("Department", v.pick("department", _DEPARTMENTS)),
        ("Start date", v.date("start")),
        ("Manager", v.name("manager")),
        ("Office", v.pick("office", _CITIES)),
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


def card(v: _Values) -> Image.Image:
    rng = v.rng
    img = Image.new("RGB", (856, 540), (236, 242, 250))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, 856, 90), fill=(30, 60, 120))
    d.text((40, 25), "CITY LIBRARY", font=_font(36, True), fill="white")
    d.text((560, 35), "MEMBERSHIP CARD", font=_font(22, True), fill="white")
    rows = (
        ("Name", v.name("member")),
        ("Member No.", f"{rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"),
        ("Valid until", v.date("valid")),
        ("Branch", v.pick("branch", _CITIES)),
    )
    for i, (label, value) in enumerate(rows):
        d.text((40, 140 + 80 * i), label, font=_font(22), fill=(60, 60, 60))
        d.text((300, 136 + 80 * i), value, font=_font(30, True), fill="black")
    d.text(
        (40, 480), "Not transferable. Please return if found.", font=_font(18), fill=(60, 60, 60)
    )
    return img


RENDERERS: dict[str, Callable[[_Values], Image.Image]] = {
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
    img = RENDERERS[layout](_Values(layout, copy, random.Random(f"{layout}:{copy}")))
    if scanned:
        img = rescan(img, random.Random(f"{layout}:{copy}:scan"))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()
