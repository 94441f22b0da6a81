"""The n-gram planner replayed on fixed answers under fixed timing models (issue 4).

bench_spec measures the planner end to end, where the ring's timing noise, pipelining
and the text each run generates all move the figures. This replay holds everything but
the planner fixed: the answers are a bench_spec JSON's plain-decoding (greedy) answers,
so the target's choice at every position is known; each round the real n-gram drafter
drafts through the real `draft_round` and planner, greedy acceptance is walked against the
answer (`accept_as_committed`), and the round costs a fixed timing model's
`fixed + per_row * (nodes + 1)` seconds, which the planner then learns as it would from the
ring. One round in flight (no pipelining); drafting time is not charged (an n-gram lookup
costs well under a millisecond). Reported per category and group: tokens per traversal
(tau) and model-time speed-up over plain decoding (one row per traversal), for the planner
and for fixed chains and trees; and how acceptance depends on a node's depth: at every
answer position a chain of 24 is drafted and walked, and per depth bucket the share of
tried nodes accepted (given the parent was) is counted, per n-gram match length. The
replay and the depth count are `coordinator.spec.replay`'s; this script runs them.

    python scripts/bench_planner.py --json OUT [--answers docs/results/history/bench_spec_wan_all_fp8_81e08f5.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.spec.draft_round import PROBE_EVERY_ROUNDS  # noqa: E402
from coordinator.spec.drafting import DraftBudget  # noqa: E402
from coordinator.spec.replay import DEPTH_BUCKETS, acceptance_by_depth, replay  # noqa: E402
from scripts import spec_prompts  # noqa: E402

# (fixed s, per row s): the CPU ring of bench_spec (4 stages on 2 cores, 25 ms a hop:
# the planner there measures 200-280 ms and 4-7 ms a row) and a GPU-like ring (same
# links, rows nearly free until the GPU is busy).
TIMINGS = {"cpu-ring": (0.215, 0.005), "gpu-like": (0.130, 0.0003)}
FIXED_SHAPES = {"chain 4": DraftBudget.chain(4), "chain 8": DraftBudget.chain(8), "chain 16": DraftBudget.chain(16),
                "tree 32x16": DraftBudget(32, 16), "tree 64x24": DraftBudget(64, 24)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--answers", default="docs/results/history/bench_spec_wan_all_fp8_81e08f5.json",
                    help="a bench_spec JSON whose plain-decoding answers are replayed")
    args = ap.parse_args(argv)
    bench = json.load(open(args.answers))
    answers = spec_prompts.plain_answers(bench)
    policies: dict[str, DraftBudget | None] = {"planner": None, **FIXED_SHAPES}
    groups = {**{c: [c] for c in spec_prompts.CATEGORIES}, "open_ended": [c for c in spec_prompts.CATEGORIES
              if c not in spec_prompts.GROUNDED], "grounded": list(spec_prompts.GROUNDED)}
    table: dict = {}
    for timing_name, timing in TIMINGS.items():
        plain_s = timing[0] + timing[1]
        for name, policy in policies.items():
            per_cat: dict[str, list[float]] = {}
            for category, prompt, answer in answers:
                traversals, seconds, _ = replay(prompt, answer, timing, policy)
                row = per_cat.setdefault(category, [0, 0, 0.0])
                row[0] += len(answer) - 1
                row[1] += traversals
                row[2] += seconds
            out = {}
            for group, cats in groups.items():
                tokens, traversals, seconds = (sum(per_cat[c][j] for c in cats) for j in range(3))
                out[group] = {"tau": round(tokens / traversals, 3), "speedup_vs_plain": round(tokens * plain_s / seconds, 3)}
            table.setdefault(timing_name, {})[name] = out
            print(f"{timing_name:9} {name:18} " + "  ".join(
                f"{g} {v['tau']:.2f}/{v['speedup_vs_plain']:.2f}x" for g, v in out.items() if g in ("open_ended", "grounded", "quoting", "summarisation")), flush=True)
    by_depth: dict = {}
    for group in ("open_ended", "grounded"):
        counts: dict = {}
        for category, prompt, answer in answers:
            if category in groups[group]:
                acceptance_by_depth(prompt, answer, counts)
        by_depth[group] = {source: {f"{lo}-{hi}": {"rate": round(a / t, 3) if t else None, "tried": t}
                                    for (lo, hi), (a, t) in zip(DEPTH_BUCKETS, rows)}
                           for source, rows in sorted(counts.items())}
        for source, rows in by_depth[group].items():
            print(f"{group:10} {source:8} accepted/tried by depth: " + "  ".join(
                f"{d} {v['rate']:.2f} ({v['tried']})" for d, v in rows.items() if v["tried"]), flush=True)
    result = {"conditions": {"answers": args.answers, "answers_git_revision": bench["conditions"].get("git_revision"),
                             "prompts": len(answers), "timings_fixed_s_per_row_s": TIMINGS,
                             "drafter": "n-gram (coordinator.spec.drafting.NgramDrafter defaults)",
                             "rounds_in_flight": 1, "draft_time": "not charged", "probe_every_rounds": PROBE_EVERY_ROUNDS,
                             "speedup_vs_plain": "model time: plain decoding costs fixed + per_row a token"},
              "results": table, "acceptance_by_depth": by_depth}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
