"""Speculative decoding on the emulated ring: every drafting mode side by side (issue 4).

One process, on the default model (SmolLM2-135M-Instruct, fp32 weights on CPU) and a ring
of 4 real stages with 25 ms one-way per hop and 50 Mbit/s uplinks (every edge, including
coordinator -> head and tail -> coordinator). For each wire dtype and drafting mode a
ring is formed, warmed up with one short request, and runs the prompt set of
scripts/spec_prompts.py (six categories) greedily, stopping at EOS or --tokens. Per
category and mode: tokens per traversal (tau), decode tok/s and its ratio to plain ring
decoding, the drafter's share of decode time (its propose/observe calls), ring wire bytes
per committed token (every edge), and whether the output equals plain decoding. Modes
the engine does not support are reported as unavailable, never faked. The main wire is
bf16; fp8 reruns the drafting modes to show what it does to acceptance.

    python scripts/bench_spec.py --json OUT [--quick] [--no-fp8] [--modes none,ngram,eagle,hybrid,eagle-tree]

A mode may carry '@pN' to cap the rounds in flight at N (ngram@p1: no pipelining).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.jobs.engine import encode_chat  # noqa: E402
from coordinator.errors import CoordinatorError, NotReadyError  # noqa: E402
from coordinator.jobs.engine_config import EngineConfig, parse_tree  # noqa: E402
from coordinator.spec.sampling import SamplingParams  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from scripts.bench_ringkit import LinkSpec, base_conditions, open_bench_ring  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
EMULATED = LinkSpec(one_way_latency_ms=25.0, upload_mbps=50.0)
STAGES = 4
# What the engine raises when a mode cannot run here (no EAGLE head for the model: a
# NotReadyError; a mode this engine does not know); anything else is a bug and propagates.
UNAVAILABLE_ERRORS = (NotReadyError, ValueError, LookupError, OSError, NotImplementedError)


def time_drafters(job) -> list[float]:
    """Accumulate seconds spent in the job's drafters (propose and, for model drafters,
    observe) into the returned one-element list."""
    spent = [0.0]
    for drafter, name in ((d, n) for d in job.drafters for n in ("propose", "observe")):
        fn = getattr(drafter, name, None)
        if not callable(fn):
            continue

        def timed(*args, _fn=fn, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(drafter, name, timed)
    return spent


async def run_prompt(ring, ids: list[int], max_tokens: int) -> dict:
    engine = ring.engine
    job = await engine.open_job(ids, GREEDY)
    draft_spent = time_drafters(job)
    out, times, at_first = [], [], None
    try:
        async with contextlib.aclosing(job.next_tokens()) as blocks:
            async for block in blocks:
                now = time.perf_counter()
                if at_first is None:
                    at_first = (ring.probe.total_bytes(), draft_spent[0])
                out += block
                times += [now] * len(block)
                eos = next((i for i, t in enumerate(out) if t in engine.eos_token_ids), None)
                if eos is not None:
                    out = out[:eos + 1]
                if eos is not None or len(out) >= max_tokens:
                    break
    finally:
        await job.aclose()
    n = min(len(out), max_tokens)
    stats = job.stats()
    decode_s = times[n - 1] - times[0]
    return {"tokens": out[:n], "decode_tokens": n - 1, "decode_s": decode_s, "traversals": stats["traversals"],
            "tau": stats["tokens_per_traversal"], "draft_rounds": stats["draft_rounds"],
            "draft_round_tokens": stats["draft_round_tokens"], "drafter_skipped_rounds": stats["drafter_skipped_rounds"],
            "draft_s": draft_spent[0] - at_first[1], "decode_bytes": ring.probe.total_bytes() - at_first[0],
            "ttft_s": stats["ttft_s"], "pipelined_rounds": stats["pipelined_rounds"],
            "pipelined_rounds_discarded": stats["pipelined_rounds_discarded"],
            "most_rounds_in_flight": stats["most_rounds_in_flight"], "planner": stats["planner"]}


def engine_config(mode: str, eagle_tree: tuple[int, int]) -> EngineConfig:
    """'eagle-tree' is EAGLE with a fixed tree (what the head can commit per traversal);
    the other modes are the engine's own, trees sized per round by the planner. A suffix
    '@pN' caps the rounds in flight at N ('ngram@p1': no pipelining)."""
    mode, _, cap = mode.partition("@p")
    depth = {"max_pipeline_depth": int(cap)} if cap else {}
    if mode == "eagle-tree":
        return EngineConfig(draft="eagle", eagle_tree=eagle_tree, **depth)
    return EngineConfig(draft=mode, **depth)


async def run_mode(store, tokenizer, wire: str, mode: str, prompts: list[tuple[str, list[int]]], max_tokens: int,
                   eagle_tree: tuple[int, int], link: LinkSpec = EMULATED) -> dict:
    try:
        config = engine_config(mode, eagle_tree)
    except UNAVAILABLE_ERRORS as exc:
        return {"available": False, "why": f"EngineConfig(draft={mode!r}): {exc}"}
    t0 = time.perf_counter()
    try:
        async with open_bench_ring(store, tokenizer, STAGES, link, wire, config) as ring:
            return await _run_on_ring(ring, wire, mode, prompts, max_tokens, time.perf_counter() - t0)
    except UNAVAILABLE_ERRORS as exc:
        return {"available": False, "why": f"draft={mode!r}: {type(exc).__name__}: {exc}"}


async def _run_on_ring(ring, wire: str, mode: str, prompts: list[tuple[str, list[int]]], max_tokens: int,
                       formed_s: float) -> dict:
    drafters = [type(d).__name__ for d in ring.engine.make_drafters()]
    if mode != "none" and not drafters:
        return {"available": False, "why": f"the engine makes no drafter for draft={mode!r} (plain decoding)"}
    runs = []
    try:
        await run_prompt(ring, prompts[0][1], 4)  # warm-up: streams opened, caches touched
        for category, ids in prompts:
            r = await run_prompt(ring, ids, max_tokens)
            runs.append({"category": category, **r})
            print(f"  {wire:4} {mode:10} {category:14} tau {r['tau']:.2f}  {r['decode_tokens'] / max(r['decode_s'], 1e-9):6.2f} tok/s"
                  f"  {r['decode_tokens'] + 1} tokens", flush=True)
    except CoordinatorError as exc:  # the mode exists but cannot generate on this ring: say so, go on
        return {"available": False, "why": f"draft={mode!r} failed on the ring after {len(runs)} prompts: "
                                           f"{type(exc).__name__}: {exc}"}
    return {"available": True, "drafters": drafters, "stages": ring.stages, "ring_formed_s": formed_s, "runs": runs}


def aggregate(runs: list[dict]) -> dict:
    """Ratios of sums over prompts (not means of ratios): long answers weigh more."""
    gen = sum(r["decode_tokens"] + 1 for r in runs)
    dec = sum(r["decode_tokens"] for r in runs)
    dec_s = sum(r["decode_s"] for r in runs)
    rounds: dict[str, int] = {}
    committed: dict[str, int] = {}
    for r in runs:
        for k, v in r["draft_rounds"].items():
            rounds[k] = rounds.get(k, 0) + v
        for k, v in r.get("draft_round_tokens", {}).items():
            committed[k] = committed.get(k, 0) + v
    return {"prompts": len(runs), "tokens": gen, "tau": gen / max(sum(r["traversals"] for r in runs), 1),
            "decode_tok_per_s": dec / dec_s if dec_s > 0 else None,
            "draft_time_share": sum(r["draft_s"] for r in runs) / dec_s if dec_s > 0 else None,
            "wire_bytes_per_token": sum(r["decode_bytes"] for r in runs) / max(dec, 1), "draft_rounds": rounds,
            "pipelined_rounds": sum(r.get("pipelined_rounds", 0) for r in runs),
            "pipelined_rounds_discarded": sum(r.get("pipelined_rounds_discarded", 0) for r in runs),
            "most_rounds_in_flight": max((r.get("most_rounds_in_flight", 1) for r in runs), default=1),
            "drafter_skipped_rounds": {k: sum(r.get("drafter_skipped_rounds", {}).get(k, 0) for r in runs)
                                       for k in {k for r in runs for k in r.get("drafter_skipped_rounds", {})}},
            # tokens per traversal of each drafter's own rounds: its acceptance, whatever the router's mix
            "tau_by_drafter": {k: committed[k] / rounds[k] for k in committed if rounds.get(k)}}


def summarise(results: dict, main_wire: str) -> dict:
    """Per wire, mode and group (each category, open-ended, grounded, all): aggregates,
    speed-up over plain on the main wire, and losslessness against plain."""
    groups = {**{c: (c,) for c in spec_prompts.CATEGORIES}, "open_ended": spec_prompts.OPEN_ENDED,
              "grounded": spec_prompts.GROUNDED, "all": spec_prompts.CATEGORIES}
    plain = results.get(main_wire, {}).get("none", {})
    plain_runs = plain.get("runs", []) if plain.get("available") else []
    table: dict = {}
    for wire, modes in results.items():
        for mode, res in modes.items():
            if not res.get("available"):
                continue
            for group, cats in groups.items():
                runs = [r for r in res["runs"] if r["category"] in cats]
                if not runs:
                    continue
                row = aggregate(runs)
                base = [r for r in plain_runs if r["category"] in cats]
                if base and row["decode_tok_per_s"]:
                    row["speedup_vs_plain"] = row["decode_tok_per_s"] / aggregate(base)["decode_tok_per_s"]
                    same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs, base))
                    row["identical_to_plain"] = f"{same}/{len(runs)}"
                table.setdefault(wire, {}).setdefault(mode, {})[group] = row
    return table


def targets(table: dict, main_wire: str, fp8_wire: str | None) -> list[dict]:
    rows = []

    def add(name, value, goal, ok):
        rows.append({"target": name, "value": value, "goal": goal, "pass": ok})

    main = table.get(main_wire, {})
    drafting = {m: t for m, t in main.items() if m != "none"}
    for group, goal in (("open_ended", 3.0), ("grounded", 5.0)):
        best = max(((t[group].get("speedup_vs_plain") or 0, m) for m, t in drafting.items() if group in t), default=None)
        if best is None:
            add(f"best mode tok/s / plain on {group}", "no drafting mode ran", f">= {goal}", False)
        else:
            add(f"best mode ({best[1]}) tok/s / plain on {group}", round(best[0], 3), f">= {goal}", best[0] >= goal)
    eagle = main.get("eagle-tree", main.get("eagle", {})).get("open_ended")
    add(f"EAGLE tree tau on open-ended ({'eagle-tree' if 'eagle-tree' in main else 'eagle'})", round(eagle["tau"], 3) if eagle else "eagle unavailable", ">= 3.0",
        bool(eagle and eagle["tau"] >= 3.0))
    if fp8_wire:
        for mode, t in table.get(fp8_wire, {}).items():
            ref = main.get(mode, {}).get("all")
            if ref and mode != "none":
                change = abs(t["all"]["tau"] - ref["tau"]) / ref["tau"]
                add(f"fp8 vs {main_wire} wire: relative tau change ({mode})", round(change, 4), "< 0.05", change < 0.05)
                rows[-1] |= {"wire": fp8_wire, "mode": mode}
                for family, tau in t["all"].get("tau_by_drafter", {}).items():
                    base = ref.get("tau_by_drafter", {}).get(family)
                    if base and len(t["all"]["tau_by_drafter"]) > 1:
                        change = abs(tau - base) / base
                        add(f"fp8 vs {main_wire} wire: relative tau change of {family} rounds ({mode})",
                            round(change, 4), "< 0.05", change < 0.05)
    return rows


def aux_rows(table: dict, main_wire: str, aux_wire: str) -> list[dict]:
    """fp8 aux features on the bf16 wire: tau change (the fp8 target) and speed, per mode."""
    rows = []
    for mode, t in table.get(aux_wire, {}).items():
        ref = table.get(main_wire, {}).get(mode, {}).get("all")
        if ref:
            change = abs(t["all"]["tau"] - ref["tau"]) / ref["tau"]
            rows.append({"target": f"fp8 aux on the {main_wire} wire: relative tau change ({mode})",
                         "value": round(change, 4), "goal": "< 0.05", "pass": change < 0.05,
                         "wire": aux_wire, "mode": mode})
            rows.append({"target": f"fp8 aux on the {main_wire} wire: decode tok/s ratio ({mode})",
                         "value": round(t["all"]["decode_tok_per_s"] / ref["decode_tok_per_s"], 4), "goal": "report",
                         "pass": True})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="one prompt per category, short answers (< 3 min)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="none,ngram,eagle,hybrid,eagle-tree",
                    help="comma-separated; 'none' (plain) is the baseline, 'eagle-tree' EAGLE with --eagle-tree")
    ap.add_argument("--eagle-tree", default="60,6", help="NODES,DEPTH of the eagle-tree mode's fixed tree")
    ap.add_argument("--per-category", type=int, default=3, help="prompts per category (at most 3)")
    ap.add_argument("--tokens", type=int, default=None, help="max new tokens per prompt (default 48, quick 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stages take turns on them)")
    ap.add_argument("--upload-mbps", type=float, default=EMULATED.upload_mbps,
                    help="every sender's emulated uplink (0: unlimited)")
    ap.add_argument("--latency-ms", type=float, default=EMULATED.one_way_latency_ms,
                    help="emulated one-way latency per hop (0 with --upload-mbps 0: plain loopback)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 reruns (comparisons on the bf16 wire only)")
    ap.add_argument("--aux-fp8", action="store_true",
                    help="also rerun the drafting modes with bf16 hidden states and fp8 EAGLE aux features (bf16@fp8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    store = open_or_prepare(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    per_category = 1 if args.quick else args.per_category
    max_tokens = args.tokens or (16 if args.quick else 48)
    eagle_tree = parse_tree(args.eagle_tree)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    prompts = [(cat, encode_chat(tokenizer, spec_prompts.messages(p))) for cat, p in spec_prompts.prompt_set(per_category)]
    main_wire, fp8_wire, aux_wire = "bf16", "fp8", "bf16@fp8"
    link = LinkSpec(one_way_latency_ms=args.latency_ms, upload_mbps=args.upload_mbps)
    conditions = {**base_conditions(store), "stages": STAGES, "link": link.describe(),
                  "prompts": f"scripts/spec_prompts.py, {per_category} per category, chat template",
                  "prompt_tokens": {cat: [len(i) for c, i in prompts if c == cat] for cat in spec_prompts.CATEGORIES},
                  "max_new_tokens": max_tokens, "stop": "EOS or max_new_tokens", "sampling": "greedy",
                  "modes": modes, "eagle_tree_mode": f"EAGLE, fixed tree of {eagle_tree[0]} nodes, depth {eagle_tree[1]}",
                  "main_wire_dtype": main_wire, "fp8_rerun": "none" if args.no_fp8 else "drafting modes only" + (
                      " (first available)" if args.quick else ""), "aux_fp8_rerun": "drafting modes, bf16 hidden + fp8 aux (wire 'bf16@fp8')" if args.aux_fp8 else "none",
                  "pipeline": "mode@pN: at most N rounds in flight "
                      f"(default {EngineConfig.max_pipeline_depth})",
                  "decode_tok_per_s": "tokens after the first / time from first to last token, summed over prompts",
                  "draft_time_share": "drafter propose+observe seconds after the first token / decode seconds",
                  "wire_bytes_per_token": "bytes sent on every ring edge after the first token / decode tokens",
                  "quick": args.quick}
    print(f"conditions: {json.dumps(conditions)}", flush=True)
    results: dict = {main_wire: {}, fp8_wire: {}}
    for mode in modes:
        results[main_wire][mode] = trio.run(lambda: run_mode(store, tokenizer, main_wire, mode, prompts, max_tokens, eagle_tree, link))
        if not results[main_wire][mode]["available"]:
            print(f"  {mode}: unavailable ({results[main_wire][mode]['why']})", flush=True)
    for mode in [m for m in modes if m != "none" and results[main_wire][m]["available"] and not args.no_fp8][
            : 1 if args.quick else None]:
        results[fp8_wire][mode] = trio.run(lambda: run_mode(store, tokenizer, fp8_wire, mode, prompts, max_tokens, eagle_tree, link))
    if args.aux_fp8:
        results[aux_wire] = {}
        for mode in [m for m in modes if m != "none" and results[main_wire][m]["available"]]:
            results[aux_wire][mode] = trio.run(lambda: run_mode(store, tokenizer, aux_wire, mode, prompts, max_tokens, eagle_tree, link))
    conditions["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    table = summarise(results, main_wire)
    result = {"conditions": conditions, "unavailable": {m: r["why"] for m, r in results[main_wire].items() if not r["available"]},
              "summary": table, "targets": targets(table, main_wire, fp8_wire) + aux_rows(table, main_wire, aux_wire),
              "raw": results}
    for row in result["targets"]:  # an end-to-end tau change mixes the wire's effect with changed answers
        mode = row.get("mode")
        if mode and mode in results.get(row["wire"], {}):
            same = sum(a["tokens"] == b["tokens"] for a, b in zip(results[main_wire][mode]["runs"],
                                                                   results[row["wire"]][mode]["runs"]))
            row["note"] = (f"{same}/{len(results[main_wire][mode]['runs'])} answers identical on both wires; "
                           "scripts/bench_wire_tau.py measures the wire on identical texts")
    if link != EMULATED:  # the goals are stated for the default link only
        for row in result["targets"]:
            row["note"] = "; ".join(filter(None, (row.get("note"), f"goal defined for {EMULATED.describe()}; "
                                                  f"this run: {link.describe()}")))
    report(result, main_wire)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def report(result: dict, main_wire: str) -> None:
    cols = ("tau", "decode_tok_per_s", "speedup_vs_plain", "draft_time_share", "wire_bytes_per_token", "identical_to_plain")
    print(f"\n{'wire':5} {'mode':10} {'group':14} " + " ".join(f"{c[:14]:>14}" for c in cols))
    for wire, modes in result["summary"].items():
        for mode, groups in modes.items():
            for group, row in groups.items():
                cells = [row.get(c) for c in cols]
                print(f"{wire:5} {mode:10} {group:14} " + " ".join(
                    f"{c:>14.3f}" if isinstance(c, float) else f"{str(c):>14}" for c in cells))
    for mode, why in result["unavailable"].items():
        print(f"{mode}: unavailable: {why}")
    for t in result["targets"]:
        print(f"[{'PASS' if t['pass'] else 'FAIL'}] {t['target']}: {t['value']} (goal {t['goal']})"
              + (f" [{t['note']}]" if "note" in t else ""))


if __name__ == "__main__":
    sys.exit(main())
