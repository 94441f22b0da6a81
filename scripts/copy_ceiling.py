"""How much of the benchmark's answers a copying drafter could ever commit (issue 4).

Reads a bench_spec JSON's plain-decoding answers and, at every answer position, compares
what the n-gram drafter's chain of 16 gets accepted (greedy: the answer itself is the
target's choice) with an oracle copier: the longest run, at most 16 tokens, that
continues the text from some earlier occurrence of the current token in the prompt or the
answer so far. The oracle is the ceiling of any prompt-lookup drafter that anchors on the
last token, so a grounded category whose oracle is short cannot reach a large speed-up
by copying, whatever the drafter's tree or pipeline.

    python scripts/copy_ceiling.py docs/results/bench_spec.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.spec.drafting import DraftBudget, NgramDrafter  # noqa: E402
from coordinator.spec.replay import accepted_length  # noqa: E402
from scripts import spec_prompts  # noqa: E402

LONGEST = 16


def oracle_copy(ctx: list[int], p: int) -> int:
    """Longest continuation of ctx after position p copied from an earlier occurrence of ctx[p]."""
    best = 0
    for j in range(p):
        if ctx[j] != ctx[p]:
            continue
        n = 0
        while n < LONGEST and p + 1 + n < len(ctx) and ctx[j + 1 + n] == ctx[p + 1 + n]:
            n += 1
        best = max(best, n)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    bench = json.load(open(args.bench_json))
    table: dict[str, dict] = {}
    for category, ids, answer in spec_prompts.plain_answers(bench):
        ctx = ids + answer
        drafter = NgramDrafter()
        row = table.setdefault(category, {"positions": 0, "ngram_chain16": 0, "oracle_copy": 0})
        for p in range(len(ids) - 1, len(ctx) - 1):
            draft = drafter.propose(ctx[:p + 1], DraftBudget.chain(LONGEST))
            row["positions"] += 1
            row["ngram_chain16"] += accepted_length(draft, ctx[p + 1:])
            row["oracle_copy"] += oracle_copy(ctx, p)
    out = {c: {"positions": r["positions"], "ngram_chain16_accepted_mean": round(r["ngram_chain16"] / r["positions"], 3),
               "oracle_copy_mean": round(r["oracle_copy"] / r["positions"], 3)} for c, r in table.items()}
    for c, r in out.items():
        print(f"{c:14} positions {r['positions']:4}  n-gram chain-16 accepts {r['ngram_chain16_accepted_mean']:.2f}"
              f"  oracle copy {r['oracle_copy_mean']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.bench_json, "git_revision": bench["conditions"].get("git_revision"),
                       "longest": LONGEST, "per_category": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
