"""Write the PickScore prompt set (flow_grpo's dataset/pickscore) as JSONL prompt rows.

    python scripts/make_pickscore_prompts.py --src <flow_grpo>/dataset/pickscore --out data/pickscore

reads train.txt and test.txt (one prompt a line, as flow_grpo ships them) and writes train.jsonl and
val.jsonl, one {"prompt": ...} row a line; blank lines are dropped. The recipes sd35_flowgrpo_pickscore
and sd35_flowgrpo_dinalrm train on them.
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="the directory holding train.txt and test.txt")
    p.add_argument("--out", default="data/pickscore")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, target in (("train.txt", "train.jsonl"), ("test.txt", "val.jsonl")):
        prompts = [line.strip() for line in (Path(args.src) / name).read_text().splitlines() if line.strip()]
        (out / target).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"{out / target}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
