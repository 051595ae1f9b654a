"""Write a small K12-style visual math set in the MMK12 format, with rendered images and exact answers.

    python scripts/make_k12_data.py --out data/mmk12_tiny --train 32 --val 8 --size 64 [--seed 0]

Each split is written twice, as <split>.parquet (images embedded as {"bytes", "path"}, the Hugging Face
datasets layout) and as <split>.jsonl (images as paths under images/), so both loaders of
omnirl.data.mmk12 have data. Five kinds of problem, in turn: the area and the perimeter of a rectangle
whose side lengths are written on it, the sum of two fractions on a board (answers like \\frac{5}{6}),
the value of an arithmetic expression on a board (four options), and the tallest of four bars (four
options). Every row also records its "kind" and its drawing parameters ("params", JSON), from which
its answer follows exactly.
"""

import argparse
import io
import json
import random
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

KINDS = ["rect_area", "rect_perimeter", "fraction_sum", "arith_choice", "tallest_bar"]
BOARD = (30, 80, 50)  # chalkboard green
BAR = (40, 90, 200)  # bar blue, the only blue in a bar chart
LETTERS = "ABCD"


def latex(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def rect_image(w: int, h: int, size: int) -> Image.Image:
    """A w x h rectangle drawn to scale (black outline) with its side lengths written next to it."""
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=max(8, size // 5))
    unit = (size - size // 3) / max(w, h)
    x0, y0 = 2, 2
    x1, y1 = x0 + round(w * unit), y0 + round(h * unit)
    d.rectangle((x0, y0, x1, y1), outline="black", width=1)
    d.text(((x0 + x1) / 2, y1 + 1), str(w), fill="red", font=font, anchor="mt")
    d.text((x1 + 2, (y0 + y1) / 2), str(h), fill="red", font=font, anchor="lm")
    return img


def board_image(text: str, size: int) -> Image.Image:
    img = Image.new("RGB", (size, size), BOARD)
    font = ImageFont.load_default(size=max(8, size // 5))
    ImageDraw.Draw(img).text((size / 2, size / 2), text, fill="white", font=font, anchor="mm")
    return img


def bars_image(heights: list[int], size: int) -> Image.Image:
    """Bars of the given heights (units of size / 12 px), numbered 1.. underneath."""
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=max(8, size // 6))
    slot = size / len(heights)
    base = size - size // 5
    for i, h in enumerate(heights):
        x0 = round(i * slot + slot / 4)
        x1 = round((i + 1) * slot - slot / 4)
        d.rectangle((x0, base - round(h * size / 12), x1, base), fill=BAR)
        d.text(((x0 + x1) / 2, base + 1), str(i + 1), fill="black", font=font, anchor="mt")
    return img


def make_row(kind: str, rng: random.Random, size: int) -> tuple[Image.Image, dict]:
    """(image, row) of one problem; the row has question, answer, choices (or None), kind, params."""
    choices = None
    if kind in ("rect_area", "rect_perimeter"):
        w, h = rng.randint(2, 9), rng.randint(2, 9)
        params = {"w": w, "h": h}
        image = rect_image(w, h, size)
        what = "area" if kind == "rect_area" else "perimeter"
        question = f"The side lengths of the rectangle are written next to it. What is its {what}?"
        answer = str(w * h if kind == "rect_area" else 2 * (w + h))
    elif kind == "fraction_sum":
        a, b, c, d = rng.randint(1, 4), rng.randint(2, 6), rng.randint(1, 4), rng.randint(2, 6)
        params = {"a": a, "b": b, "c": c, "d": d}
        image = board_image(f"{a}/{b}+{c}/{d}", size)
        question = "Compute the value of the expression on the board. Give it as an exact fraction."
        answer = latex(Fraction(a, b) + Fraction(c, d))
    elif kind == "arith_choice":
        a, b, c = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 9)
        params = {"a": a, "b": b, "c": c}
        image = board_image(f"{a}+{b}·{c}", size)  # the built-in font has no ×
        value = a + b * c
        # Distractors: the left-to-right misreading (a + b) * c and near misses, all distinct.
        options = {value, (a + b) * c}
        while len(options) < 4:
            options.add(value + rng.choice([-3, -2, -1, 1, 2, 3]))
        options = sorted(options)
        rng.shuffle(options)
        question = "What is the value of the expression on the board?"
        choices = [str(v) for v in options]
        answer = LETTERS[options.index(value)]
    else:
        assert kind == "tallest_bar", kind
        heights = rng.sample(range(2, 10), 4)
        params = {"heights": heights}
        image = bars_image(heights, size)
        question = "Which bar in the chart is the tallest?"
        choices = [f"bar {i + 1}" for i in range(4)]
        answer = LETTERS[heights.index(max(heights))]
    row = {
        "question": question,
        "answer": answer,
        "choices": choices,
        "kind": kind,
        "params": json.dumps(params),
    }
    return image, row


def write_split(out: Path, split: str, n: int, size: int, rng: random.Random) -> None:
    (out / "images").mkdir(parents=True, exist_ok=True)
    parquet_rows, jsonl_lines = [], []
    for i in range(n):
        image, row = make_row(KINDS[i % len(KINDS)], rng, size)
        name = f"{split}_{i:04d}.png"
        buf = io.BytesIO()
        image.save(buf, format="PNG", optimize=True)
        (out / "images" / name).write_bytes(buf.getvalue())
        row = {"id": f"k12-{split}-{i:04d}", **row}
        parquet_rows.append({**row, "image": {"bytes": buf.getvalue(), "path": name}})
        jsonl_row = {**row, "image": f"images/{name}"}
        if jsonl_row["choices"] is None:
            del jsonl_row["choices"]
        jsonl_lines.append(json.dumps(jsonl_row))
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("question", pa.string()),
            ("answer", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("kind", pa.string()),
            ("params", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(parquet_rows, schema=schema), out / f"{split}.parquet")
    (out / f"{split}.jsonl").write_text("\n".join(jsonl_lines) + "\n")
    print(f"wrote {n} rows to {out / f'{split}.parquet'} and {out / f'{split}.jsonl'}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="data/mmk12_tiny")
    p.add_argument("--train", type=int, default=32)
    p.add_argument("--val", type=int, default=8)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    for split, n in (("train", a.train), ("val", a.val)):
        write_split(Path(a.out), split, n, a.size, rng)


if __name__ == "__main__":
    main()
