"""What the wire dtype does to draft acceptance, on identical contexts (issue 4).

bench_spec compares bf16 and fp8 rings end to end, but there the two wires generate
different texts (fp8 moves the target's own near-ties) and the planner sizes drafts from
measured time, so its tau difference mixes the wire's effect with the text's. This
benchmark holds the text fixed. It runs the default model's real stages (4 stages of
near-equal layer counts, as the emulated ring's equal nodes get by measured speed, which
bench_spec does not record; in one process, no network), converting the hidden
states and the EAGLE aux features to and from the wire dtype at every stage edge exactly
as the nodes do (`shard.activations.to_wire` / `from_wire`, aux re-encoded by each stage
that appends a layer), over a reference text: the fp32 pipeline's greedy answer to each
prompt of scripts/spec_prompts.py. Teacher forcing gives, per wire, every position's aux
features and the target's greedy token. At every answer position each drafter then
drafts from the reference prefix (EAGLE on that wire's aux features), and greedy
verification is walked against that wire's target: a draft token is accepted when it is
the target's greedy token there; the walk stops at the first miss or when an accepted
token leaves the reference (the target's next choice off the reference is unknown;
`coordinator.spec.replay.walk`).
tau = 1 + accepted tokens. Also reported: how often each wire's greedy token differs from
the fp32 reference (the target's own disagreement).

    python scripts/bench_wire_tau.py --json OUT [--quick] [--wires bf16,f8_e4m3fn,bf16@f8_e4m3fn]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.spec.drafting import DraftBudget, NgramDrafter  # noqa: E402
from coordinator.spec.eagle import EagleDrafter, EagleHead, shipped_head_dir  # noqa: E402
from coordinator.spec.replay import walk  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from scripts.bench_ringkit import base_conditions  # noqa: E402
from shard.activations import from_wire, to_wire  # noqa: E402
from shard.kvcache import KVCache  # noqa: E402
from shard.layers import LayerRange  # noqa: E402
from shard.stage import OutputHead, Stage  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402

STAGES = 4
BUDGETS = {"eagle chain 4": ("eagle", DraftBudget.chain(4)), "eagle tree 32x6": ("eagle", DraftBudget(32, 6)),
           "eagle tree 60x6": ("eagle", DraftBudget(60, 6)), "ngram chain 8": ("ngram", DraftBudget.chain(8))}


def even_split(num_layers: int, stages: int) -> list[LayerRange]:
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


class Pipeline:
    """The model's stages in one process, with each edge's wire conversion."""

    def __init__(self, store, stages: int) -> None:
        cfg = store.config
        self.cfg, self.ranges = cfg, even_split(cfg.num_layers, stages)
        emb = store.load_embedding()
        self.stages = [Stage(cfg, r, store.load_layers(r), embedding=emb if r.start == 0 else None) for r in self.ranges]
        norm, lm_head = store.load_head()
        self.head = OutputHead(cfg, norm, lm_head if lm_head is not None else emb)

    def forward(self, ids: list[int], wire: str | None, aux_layers: tuple[int, ...],
                tail_wire: str | None = "", aux_wire: str | None = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass over `ids` (None: no wire, fp32 throughout) ->
        (greedy next token at each position (T,), aux features (T, k*H) as the coordinator decodes them).
        `tail_wire` / `aux_wire`, when not "", are the dtypes of the last edge's hidden
        states / of the aux features alone (what-ifs: the nodes use one dtype for all)."""
        t = len(ids)
        x: torch.Tensor = torch.tensor(ids)
        aux, aux_scale = None, None
        for n, (stage, r) in enumerate(zip(self.stages, self.ranges)):
            job = KVCache(len(r), self.cfg.num_kv_heads, self.cfg.head_dim, torch.float32, 1 << 31).open("j", t)
            wanted = [layer for layer in aux_layers if layer in r]
            h, captured = stage.forward(job, x, ctx_len=0, positions=torch.arange(t), capture=wanted)
            if captured:  # as StageWorker._aux: decode what rides, append, re-encode
                parts = [] if aux is None else [from_wire(aux, aux_scale, torch.float32)]
                parts += [captured[layer].float() for layer in aux_layers if layer in captured]
                aux, aux_scale = _wire(torch.cat(parts, dim=-1), aux_wire if aux_wire != "" else wire)
            hidden, scale = _wire(h, tail_wire if tail_wire != "" and n == len(self.stages) - 1 else wire)
            x = from_wire(hidden, scale, torch.float32)
        greedy = self.head.logits(x).argmax(dim=-1)
        return greedy, from_wire(aux, aux_scale, torch.float32)


def _wire(h: torch.Tensor, wire: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (h.float(), None) if wire is None else to_wire(h, wire)


@torch.inference_mode()
def reference(pipe: Pipeline, prompt_ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """The fp32 pipeline's greedy answer, decoded a token at a time with each stage's K/V cache."""
    cfg = pipe.cfg
    jobs = [KVCache(len(r), cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 31).open("ref", len(prompt_ids) + max_tokens)
            for r in pipe.ranges]
    ids, ctx, frame = list(prompt_ids), 0, list(prompt_ids)
    for _ in range(max_tokens):
        x: torch.Tensor = torch.tensor(frame)
        for stage, job in zip(pipe.stages, jobs):
            x, _ = stage.forward(job, x, ctx_len=ctx, positions=torch.arange(ctx, ctx + len(frame)))
        nxt = int(pipe.head.logits(x[-1:]).argmax(dim=-1))
        ctx += len(frame)
        ids.append(nxt)
        frame = [nxt]
        if nxt == eos:
            break
    return ids


def measure(pipe, head, texts: list[tuple[str, list[int], int]], wire: str) -> dict:
    """Per category: roots, how often the target differs from the reference, accepted
    tokens per budget. `wire` is HIDDEN[/TAIL][@AUX]: the hidden states' dtype, and
    optionally the last edge's hidden states' and the aux features' own dtypes."""
    per_cat: dict[str, dict] = {}
    spec, _, aux_wire = wire.partition("@")
    edges, _, tail = spec.partition("/")
    for category, ids, start in texts:
        greedy_t, aux = pipe.forward(ids, edges, head.config.aux_layers if head else (), tail, aux_wire)
        greedy = greedy_t.tolist()
        rec = per_cat.setdefault(category, {"roots": 0, "target_differs": 0, "accepted": {n: 0 for n in BUDGETS},
                                            "whole": {n: 0 for n in BUDGETS}})
        eagle, ngram = (EagleDrafter(head) if head else None), NgramDrafter()
        seen = 0
        for root in range(start - 1, len(ids) - 1):
            if eagle is not None:
                eagle.observe(ids[seen:root], aux[seen:root])
            seen = root
            rec["roots"] += 1
            rec["target_differs"] += int(greedy[root] != ids[root + 1])
            for name, (family, budget) in BUDGETS.items():
                drafter = eagle if family == "eagle" else ngram
                if drafter is None:
                    continue
                tree = drafter.propose(ids[:root + 1], budget)
                got = walk(tree, root, ids, greedy)
                rec["accepted"][name] += got
                # a chain accepted whole is what a pipelined round needs (and its bonus guessed)
                rec["whole"][name] += int(tree.num_nodes == budget.max_depth == budget.max_nodes and got == tree.num_nodes)
    return per_cat


def summarise(per_cat: dict) -> dict:
    def tau(cats: list[str]) -> dict:
        roots = sum(per_cat[c]["roots"] for c in cats if c in per_cat)
        out = {name: round(1 + sum(per_cat[c]["accepted"][name] for c in cats if c in per_cat) / max(roots, 1), 4)
               for name in BUDGETS}
        out["chain_accepted_whole"] = {name: round(sum(per_cat[c]["whole"][name] for c in cats if c in per_cat) / max(roots, 1), 4)
                                       for name, (_, b) in BUDGETS.items() if b.max_nodes == b.max_depth}
        out["target_differs_from_reference"] = round(sum(per_cat[c]["target_differs"] for c in cats if c in per_cat) / max(roots, 1), 4)
        out["roots"] = roots
        return out
    table = {c: tau([c]) for c in per_cat}
    table["open_ended"] = tau(list(spec_prompts.OPEN_ENDED))
    table["grounded"] = tau(list(spec_prompts.GROUNDED))
    table["all"] = tau(list(per_cat))
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="one prompt per category, 16 tokens")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="", help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--wires", default="bf16,f8_e4m3fn",
                    help="comma-separated, the first the baseline; each HIDDEN[/TAIL][@AUX] (what-ifs: the last "
                         "edge's hidden states in TAIL, the aux features in AUX)")
    ap.add_argument("--tokens", type=int, default=None, help="reference answer length (default 48, quick 16)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = args.tokens or (16 if args.quick else 48)
    store = open_or_prepare(args.model, progress=False)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(store.tokenizer_dir)
    head_dir = args.head or shipped_head_dir(store.manifest.name)
    head = EagleHead.load(head_dir, store.config, store.load_embedding(), store.digest) if head_dir else None
    pipe = Pipeline(store, STAGES)
    t0 = time.perf_counter()
    texts = []
    for category, prompt in spec_prompts.prompt_set(1 if args.quick else 3):
        ids = encode_chat(tokenizer, spec_prompts.messages(prompt))
        texts.append((category, reference(pipe, ids, tokens, tokenizer.eos_token_id), len(ids)))
    print(f"references: {len(texts)} texts in {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    for wire in args.wires.split(","):
        t1 = time.perf_counter()
        results[wire] = summarise(measure(pipe, head, texts, wire))
        print(f"{wire}: {json.dumps(results[wire]['all'])} ({time.perf_counter() - t1:.0f} s)", flush=True)
    wires = args.wires.split(",")
    change = {}
    for other in wires[1:]:  # against the first wire
        a, b = results[wires[0]], results[other]
        change[other] = {group: {name: round(b[group][name] / a[group][name] - 1, 4) for name in BUDGETS}
                         for group in ("open_ended", "grounded", "all")}
        print(f"tau change {other} vs {wires[0]}: {json.dumps(change[other])}")
    conditions = {k: v for k, v in base_conditions(store).items() if k != "receipts"}  # no ring, no receipts here
    out = {"benchmark": "bench_wire_tau", "conditions": conditions | {
        "process": "one process, no network: the stages called in turn, each edge's wire conversion as the nodes do",
        "stages": [[r.start, r.end] for r in pipe.ranges], "reference": "fp32 pipeline greedy", "answer_tokens": tokens,
        "prompts": len(texts), "eagle_head": str(head_dir) if head_dir else None,
        "head_sha256": json.loads((pathlib.Path(head_dir) / "manifest.json").read_text())["sha256"] if head_dir else None,
        "threads": args.threads, "wall_s": round(time.perf_counter() - t0, 1)},
        "tau": results, "relative_change_vs_first_wire": change}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
