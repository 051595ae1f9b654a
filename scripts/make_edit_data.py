"""Write a text-edit data set: rendered signs whose word the model must change (omnirl.data.edit rows).

    python scripts/make_edit_data.py --out data/edit --train 1000 --val 32 --size 512 [--seed 0]

Each row's source image is a sign (a board of random colour, size and place) showing one word, on a plain,
gradient, striped or blotchy background. The instruction asks for another word (`Make the sign read
"OPEN"`); "target_text" is that word, "region" the board's box, and "target" the same scene rendered with
the new word (a reference result). Writes OUT/{train,val}.jsonl, OUT/images/ and OUT/targets/. Rendering
uses Pillow's built-in scalable font, so the set is the same on every machine and needs no font files.
"""

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter, ImageFont

WORDS = (
    "OPEN CLOSED SALE EXIT CAFE HOTEL BAKERY PIZZA TAXI HELLO WELCOME FRESH MARKET BOOKS MUSIC PARK "
    "GARDEN RIVER NORTH SOUTH SUMMER WINTER SILVER GOLDEN QUIET BRIGHT LOCAL DAILY TOWER BRIDGE OCEAN "
    "FOREST STUDIO COFFEE LIBRARY MUSEUM STATION HARBOR VALLEY DREAM"
).split()
INSTRUCTIONS = [
    'Make the sign read "{}"',
    'Change the text on the sign to "{}"',
    'Replace the word on the board with "{}"',
    'Edit the sign so that it says "{}"',
]


def color(rng: random.Random, lo: int = 0, hi: int = 255) -> tuple[int, int, int]:
    return tuple(rng.randint(lo, hi) for _ in range(3))


def background(rng: random.Random, size: int) -> Image.Image:
    kind = rng.choice(["plain", "gradient", "stripes", "blotches"])
    a, b = color(rng, 40, 220), color(rng, 40, 220)
    if kind == "plain":
        return Image.new("RGB", (size, size), a)
    if kind == "gradient":
        ramp = Image.linear_gradient("L").resize((size, size))
        return Image.composite(Image.new("RGB", ramp.size, a), Image.new("RGB", ramp.size, b), ramp)
    if kind == "stripes":
        image = Image.new("RGB", (size, size), a)
        draw, width = ImageDraw.Draw(image), max(2, size // rng.randint(6, 16))
        for x in range(0, size, 2 * width):
            draw.rectangle([x, 0, x + width - 1, size], fill=b)
        return image.rotate(rng.choice([0, 45, 90, 135]), fillcolor=a)
    # Blotches: a coarse random grid, blown up and blurred (a texture that still compresses well).
    cells = Image.new("RGB", (6, 6))
    cells.putdata([color(rng, 40, 220) for _ in range(36)])
    return cells.resize((size, size), Image.BICUBIC).filter(ImageFilter.GaussianBlur(size / 24))


def scene(rng: random.Random, size: int, words: tuple[str, str]) -> dict:
    """Everything about an image except its word: both words of a row must fit the board."""
    width, height = rng.randint(size * 55 // 100, size * 85 // 100), rng.randint(size * 22 // 100, size // 3)
    x0, y0 = (
        rng.randint(size // 20, size - width - size // 20),
        rng.randint(size // 20, size - height - size // 20),
    )
    board = color(rng)
    # Text contrasts with the board: dark on light, light on dark.
    ink = color(rng, 0, 60) if sum(board) > 3 * 128 else color(rng, 200, 255)
    font_size = int(height * 0.6)
    while True:
        font = ImageFont.load_default(size=font_size)
        if max(font.getlength(w) for w in words) <= width * 0.85 or font_size <= 6:
            break
        font_size -= 1
    return {
        "seed": rng.random(),
        "region": [x0, y0, x0 + width, y0 + height],
        "board": board,
        "ink": ink,
        "font": font,
    }


def render(s: dict, size: int, word: str) -> Image.Image:
    """The scene `s` with `word` centred on its board (same scene, same pixels outside the board)."""
    image = background(random.Random(s["seed"]), size)
    draw = ImageDraw.Draw(image)
    x0, y0, x1, y1 = s["region"]
    draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=s["board"], outline=s["ink"], width=max(1, size // 128))
    draw.text(((x0 + x1) / 2, (y0 + y1) / 2), word, fill=s["ink"], font=s["font"], anchor="mm")
    return image


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/edit")
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--val", type=int, default=32)
    p.add_argument("--size", type=int, default=512, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.out)
    for sub in ("images", "targets"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for split, n in (("train", a.train), ("val", a.val)):
        with open(out / f"{split}.jsonl", "w") as f:
            for i in range(n):
                old, new = rng.sample(WORDS, 2)
                s = scene(rng, a.size, (old, new))
                name = f"{split}_{i:05d}.png"
                render(s, a.size, old).save(out / "images" / name, optimize=True)
                render(s, a.size, new).save(out / "targets" / name, optimize=True)
                row = {
                    "image": f"images/{name}",
                    "prompt": rng.choice(INSTRUCTIONS).format(new),
                    "target_text": new,
                    "region": s["region"],
                    "target": f"targets/{name}",
                }
                f.write(json.dumps(row) + "\n")
        print(f"wrote {n} rows to {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
