"""Builds the example's small SFT set (data/train.jsonl, data/heldout.jsonl); deterministic.

The task: pick the words of one category out of a list. The answer is a set, so a rollout may
name the right words in any order: the example's preprocess keeps the rollout's order for the
words it got right and appends the ones it missed (the seed's "reordered ground truth with the
false negatives appended"), which needs no Hungarian solver for exact words.
"""

import json
import random
from pathlib import Path

CATEGORIES = {
    "fruits": ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum", "orange"],
    "animals": ["cat", "dog", "horse", "tiger", "rabbit", "sheep", "mouse", "eagle", "zebra", "goat"],
    "colours": ["red", "blue", "green", "yellow", "purple", "black", "white", "brown", "pink", "grey"],
    "tools": ["hammer", "saw", "wrench", "drill", "shovel", "chisel", "pliers", "ladder", "rake", "axe"],
}


def sample(rng: random.Random) -> dict:
    category = rng.choice(sorted(CATEGORIES))
    members = rng.sample(CATEGORIES[category], rng.randint(1, 3))
    others = [w for c, words in CATEGORIES.items() if c != category for w in words]
    words = members + rng.sample(others, 6 - len(members))
    rng.shuffle(words)
    question = (f"Which of these words are {category}: {', '.join(words)}? "
                "Answer with the matching words only, separated by commas.")
    return {"messages": [{"role": "user", "content": question}],
            "answer": ", ".join(w for w in words if w in members)}


def main() -> None:
    rng = random.Random(20261125)
    rows = [sample(rng) for _ in range(240)]
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train.jsonl", rows[:200]), ("heldout.jsonl", rows[200:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
