"""Simulate ring selection on synthetic pools; write JSON results and PNG plots.

    python scripts/sim_network.py --json sim.json --plots docs/img

Compares upload-aware `select_ring`, the same search told uplinks are infinite
(evaluated with the real ones), a forced large-pool heuristic, and the exhaustive oracle,
on predicted TTFT and total request time. All logic lives in `ring`; this only loops,
times and draws.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ring import Constraints, InfeasibleError, Workload, evaluate, oracle_ring, reselect, select_ring  # noqa: E402
from ring.pools import KINDS, LLAMA_8B, MIXES, SMOLLM2_135M, generate_pool  # noqa: E402

MODELS = {m.name: m for m in (SMOLLM2_135M, LLAMA_8B)}
PROMPTS = (2048, 16384, 65536)
OUTPUT_TOKENS = 256
HEURISTIC = Constraints(exact_max_nodes=5)  # forces the prefilter + local-search path on small pools


def _workload(prompt: int) -> Workload:
    return Workload(prompt_tokens=prompt, output_tokens=OUTPUT_TOKENS, prefill_chunk_tokens=512,
                    round_tokens=5, expected_tokens_per_traversal=2.5)


def _summary(plan) -> dict:
    return {"ttft_s": plan.ttft_s, "total_s": plan.total_s, "decode_step_s": plan.decode_step_s,
            "stages": [[s.peer, s.layers.start, s.layers.end] for s in plan.stages]}


def run_pool(mix: str, size: int, model_name: str, seed: int, with_oracle: bool) -> list[dict]:
    model = MODELS[model_name]
    network = generate_pool(mix, size, model, seed)
    rows = []
    for prompt in PROMPTS:
        workload = _workload(prompt)
        row = {"mix": mix, "size": size, "model": model_name, "seed": seed, "prompt_tokens": prompt}
        try:
            start = time.perf_counter()
            aware = select_ring(network, model, workload)
            row["select_s"] = time.perf_counter() - start
        except InfeasibleError as err:
            rows.append(row | {"infeasible": err.reason})
            continue
        blind = evaluate(select_ring(network, model, workload, Constraints(upload_aware=False)), network, model, workload)
        row |= {"aware": _summary(aware), "blind": _summary(blind)}
        if with_oracle:
            row["heuristic"] = _summary(select_ring(network, model, workload, HEURISTIC))
            start = time.perf_counter()
            row["oracle"] = _summary(oracle_ring(network, model, workload))
            row["oracle_s"] = time.perf_counter() - start
        rows.append(row)
    return rows


def run_churn(mix: str, size: int, seed: int) -> dict:
    network, workload = generate_pool(mix, size, LLAMA_8B, seed), _workload(16384)
    plan = select_ring(network, LLAMA_8B, workload)
    gone = plan.stages[seed % len(plan.stages)].peer
    after = reselect(plan, network.without({gone}), LLAMA_8B, workload)
    before = {s.peer: s.layers for s in plan.stages}
    moved = [s.peer for s in after.stages if s.peer in before and before[s.peer] != s.layers]
    return {"mix": mix, "size": size, "seed": seed, "stages_before": len(plan.stages), "left": gone,
            "survivors_moved": moved, "move_s": after.move_s, "total_before_s": plan.total_s,
            "total_after_s": after.total_s, "fresh_total_s": select_ring(network.without({gone}), LLAMA_8B,
                                                                          workload).total_s}


def plot(results: dict, out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    small = [r for r in results["small_pools"] if "oracle" in r]
    fig, axes = plt.subplots(1, len(PROMPTS), figsize=(13, 4), sharey=True)
    for ax, prompt in zip(axes, PROMPTS):
        for key, colour in (("aware", "tab:blue"), ("heuristic", "tab:orange")):
            gaps = sorted(100 * (r[key]["total_s"] / r["oracle"]["total_s"] - 1)
                          for r in small if r["prompt_tokens"] == prompt)
            label = "select_ring (exact, <=9 nodes)" if key == "aware" else "forced heuristic (exact core of 5)"
            ax.plot(gaps, [i / len(gaps) for i in range(1, len(gaps) + 1)], drawstyle="steps-post",
                    color=colour, label=label)
        ax.axvline(2, color="grey", ls="--", lw=1)
        ax.set(title=f"{prompt // 1024}k-token prompt", xlabel="request time above oracle (%)")
        ax.set_xscale("symlog", linthresh=1)
    axes[0].set_ylabel("fraction of pools (CDF)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Gap to the exhaustive oracle, pools of 6-9 nodes (both models, all mixes)")
    fig.tight_layout()
    fig.savefig(out / "topology_oracle_gap.png", dpi=110)
    plt.close(fig)

    rows = [r for r in results["pools"] if "aware" in r and r["model"] == LLAMA_8B.name]
    mixes = sorted({r["mix"] for r in rows})
    fig, axes = plt.subplots(1, len(PROMPTS), figsize=(13, 4.2), sharey=True)
    for ax, prompt in zip(axes, PROMPTS):
        data, labels = [], []
        for mix in mixes:
            for key in ("aware", "blind"):
                data.append([r[key]["ttft_s"] for r in rows if r["mix"] == mix and r["prompt_tokens"] == prompt])
                labels.append(f"{mix[:5]}\n{key}")
        box = ax.boxplot(data, patch_artist=True)
        for patch, label in zip(box["boxes"], labels):
            patch.set_facecolor("tab:blue" if "aware" in label else "tab:red")
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
        ax.set(yscale="log", title=f"{prompt // 1024}k-token prompt")
    axes[0].set_ylabel("predicted TTFT (s, log)")
    fig.suptitle(f"{LLAMA_8B.name}: TTFT, upload-aware (blue) vs upload-blind (red), pools of 12-100 nodes")
    fig.tight_layout()
    fig.savefig(out / "topology_ttft_aware_vs_blind.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    timing = results["timing"]
    ax.plot([t["size"] for t in timing], [t["select_s"] for t in timing], "o-")
    ax.axhline(2.0, color="grey", ls="--", lw=1, label="2 s target")
    ax.set(xscale="log", yscale="log", xlabel="pool size (nodes)", ylabel="select_ring wall time (s)",
           title=f"Selection time, volunteer mix, {LLAMA_8B.name}, 16k prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "topology_select_time.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True)
    parser.add_argument("--plots", type=pathlib.Path)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per (mix, size) for oracle pools")
    parser.add_argument("--big-seeds", type=int, default=3, help="seeds per (mix, size) for larger pools")
    args = parser.parse_args(argv)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    began = time.perf_counter()
    results: dict = {
        "conditions": {
            "git_revision": revision, "python": sys.version.split()[0], "output_tokens": OUTPUT_TOKENS,
            "workload": {"prefill_chunk_tokens": 512, "round_tokens": 5, "expected_tokens_per_traversal": 2.5},
            "models": {m.name: vars(m) for m in MODELS.values()}, "mixes": MIXES,
            "kinds": {k: {f: getattr(v, f) for f in v.__dataclass_fields__} for k, v in KINDS.items()},
        },
        "small_pools": [], "pools": [], "timing": [], "churn": [],
    }
    for model_name in MODELS:
        for mix in MIXES:
            for size in (6, 7, 8, 9):
                for seed in range(args.seeds if size < 9 else 1):
                    results["small_pools"] += run_pool(mix, size, model_name, seed, with_oracle=True)
            for size in (12, 24, 48, 100):
                for seed in range(args.big_seeds):
                    results["pools"] += run_pool(mix, size, model_name, seed, with_oracle=False)
        print(f"{model_name}: done at {time.perf_counter() - began:.0f} s", file=sys.stderr)
    workload = _workload(16384)
    for size in (6, 30, 100, 300, 1000):
        network = generate_pool("volunteer", size, LLAMA_8B, 0)
        start = time.perf_counter()
        select_ring(network, LLAMA_8B, workload)
        results["timing"].append({"size": size, "select_s": time.perf_counter() - start})
    for mix in ("residential", "volunteer"):
        for size in (24, 48):
            for seed in range(args.big_seeds):
                results["churn"].append(run_churn(mix, size, seed))
    results["summary"] = summarise(results)
    results["conditions"]["sim_wall_s"] = time.perf_counter() - began
    args.json.write_text(json.dumps(results, indent=1))
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(results, args.plots)
    print(json.dumps(results["summary"], indent=1))
    return 0


def summarise(results: dict) -> dict:
    small = [r for r in results["small_pools"] if "oracle" in r]
    out: dict = {"oracle_pools": len(small), "infeasible_small_rows": sum("infeasible" in r for r in results["small_pools"])}
    for prompt in PROMPTS:
        rows = [r for r in small if r["prompt_tokens"] == prompt]
        for key in ("aware", "heuristic"):
            within = sum(r[key]["total_s"] <= 1.02 * r["oracle"]["total_s"] for r in rows)
            out[f"{key}_within_2pct_of_oracle_{prompt}"] = within / len(rows)
        beaten = sum(r["oracle"]["total_s"] < r["aware"]["total_s"] * (1 - 1e-9) for r in rows)
        out[f"oracle_beats_select_{prompt}"] = beaten
    for mix in MIXES:
        rows = [r for r in results["pools"] if "aware" in r and r["mix"] == mix and r["prompt_tokens"] == 16384
                and r["model"] == LLAMA_8B.name]
        if rows:
            out[f"median_ttft_ratio_blind_over_aware_16k_{mix}"] = statistics.median(
                r["blind"]["ttft_s"] / r["aware"]["ttft_s"] for r in rows)
            out[f"median_ttft_aware_16k_{mix}_s"] = statistics.median(r["aware"]["ttft_s"] for r in rows)
            out[f"median_ttft_blind_16k_{mix}_s"] = statistics.median(r["blind"]["ttft_s"] for r in rows)
    out["select_s_1000_nodes"] = next(t["select_s"] for t in results["timing"] if t["size"] == 1000)
    churn = results["churn"]
    out["churn_events"] = len(churn)
    out["churn_no_survivor_moved"] = sum(not c["survivors_moved"] for c in churn) / len(churn)
    out["churn_median_move_s"] = statistics.median(c["move_s"] for c in churn)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
