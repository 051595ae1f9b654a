"""Write an OCR prompt set: JSONL rows {"prompt": ..., "text": ...} whose prompt quotes the text to render.

    python scripts/make_ocr_prompts.py --out data/ocr --train 2000 --val 64 [--seed 0]

Texts are short words and phrases (signs, labels, posters), drawn from a fixed vocabulary so the set is
reproducible offline; the OCR reward scores an image by how closely rapidocr reads the quoted text.
"""

import argparse
import json
import random
from pathlib import Path

SCENES = [
    'A storefront sign that reads "{}"',
    'A neon sign glowing with the words "{}"',
    'A hand-written note on a desk saying "{}"',
    'A vintage poster with the title "{}"',
    'A coffee cup printed with the text "{}"',
    'A street banner that says "{}"',
    'A chalkboard menu reading "{}"',
    'A book cover titled "{}"',
    'A road sign with the words "{}"',
    'A T-shirt printed with "{}"',
]
WORDS = (
    "open closed sale welcome exit coffee bakery hotel garden library museum station market river "
    "summer winter sunrise harbor forest silver golden happy quiet bright fresh local daily north "
    "south east west city park bridge tower light music dream ocean mountain valley studio"
).split()


def make_text(rng: random.Random) -> str:
    n = rng.choice([1, 1, 2, 2, 3])
    return " ".join(rng.choice(WORDS) for _ in range(n)).title()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="data/ocr")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", a.train), ("val", a.val)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                text = make_text(rng)
                f.write(json.dumps({"prompt": rng.choice(SCENES).format(text), "text": text}) + "\n")
        print(f"wrote {n} prompts to {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
