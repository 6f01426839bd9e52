"""Write the tiny word-problem dataset of configs/jsonl_example.yaml: JSONL files a user's own data would
look like (a question, an answer, a domain), generated here so that nothing is downloaded.

    python tools/make_word_problems.py [OUT_DIR] [--train N] [--test N] [--seed S]

Each row: {"question": "Mia has 23 pears. She buys 14 more. How many pears does Mia have now?",
"answer": "37", "domain": "add"}; domains add and sub, two-digit numbers, answers never negative. The
files are deterministic for a seed, and the test questions are disjoint from the training ones. The
repository ships the default output (examples/word_problems/); run this to make other sizes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max")
ITEMS = ("apples", "pears", "books", "coins", "shells", "cards", "pens", "stamps")
ADD = (
    "{n} has {a} {item}. {p} buys {b} more. How many {item} does {n} have now?",
    "{n} had {a} {item} and found {b} more. How many {item} does {n} have?",
)
SUB = (
    "{n} has {a} {item}. {p} gives away {b}. How many {item} does {n} have now?",
    "{n} had {a} {item} and lost {b}. How many {item} are left?",
)


def problem(rng: random.Random) -> dict[str, str]:
    name = NAMES[int(rng.random() * len(NAMES))]
    item = ITEMS[int(rng.random() * len(ITEMS))]
    a, b = 10 + int(rng.random() * 90), 1 + int(rng.random() * 49)
    pronoun = "She" if name in ("Mia", "Ava", "Zoe", "Ivy") else "He"
    if rng.random() < 0.5:
        text, answer, domain = ADD[int(rng.random() * len(ADD))], a + b, "add"
    else:
        a, b = max(a, b), min(a, b)
        text, answer, domain = SUB[int(rng.random() * len(SUB))], a - b, "sub"
    return {
        "question": text.format(n=name, p=pronoun, a=a, b=b, item=item),
        "answer": str(answer),
        "domain": domain,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "out_dir",
        nargs="?",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "examples" / "word_problems",
    )
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--test", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng, seen, rows = random.Random(args.seed), set(), []
    while len(rows) < args.train + args.test:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("test.jsonl", rows[: args.test]), ("train.jsonl", rows[args.test :])):
        tmp = args.out_dir / f".{name}.partial"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        tmp.replace(args.out_dir / name)
        print(f"{args.out_dir / name}: {len(part)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
