"""Speculative decoding over a real in-process ring is lossless.

Guards issue 4's core promise: whatever the drafter proposes (nothing, n-gram matches,
a noisy chain, a noisy tree whose accepted paths need their K/V gathered), greedy output
equals plain ring decoding token for token. The noisy drafters corrupt a known-correct
continuation at random, so rounds accept partial paths, siblings and nothing at all —
the cases where a wrong commit or a stale KV slot would change the output.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
import torch
import trio

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget, NgramDrafter
from coordinator.jobs.ring_engine import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.spec.source import DraftSource
from tests.e2e.ringkit import generate_greedy, generate_greedy_with_stats, open_local_ring

PROMPTS = [[1, 40, 41, 42, 40, 41, 42, 40, 41], [1, 100, 7, 200, 33], [1] + list(range(3, 60))]
NEW_TOKENS = 24


class NoisyOracleDrafter:
    """Proposes the true greedy continuation with tokens corrupted at random, as a chain
    or as a tree with random wrong siblings. `truth` maps a prompt to its reference."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], tree: bool, seed: int, accuracy: float = 0.7) -> None:
        self.truth, self.tree, self.rng, self.accuracy = truth, tree, random.Random(seed), accuracy

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        for prompt, ref in self.truth.items():
            n = len(prompt)
            if tuple(context_ids[:n]) == prompt:
                done = len(context_ids) - n
                want = ref[done: done + budget.max_depth]
                break
        else:
            return DraftTree.empty()
        chain = [t if self.rng.random() < self.accuracy else self.rng.randrange(3, 259) for t in want]
        if not chain:
            return DraftTree.empty()
        branches = [chain]
        if self.tree:
            for _ in range(2):
                cut = self.rng.randrange(len(chain))
                branches.append(chain[:cut] + [self.rng.randrange(3, 259) for _ in range(len(chain) - cut)])
        return DraftTree.from_branches(branches, budget.max_nodes, source=DraftSource("noisy"))


async def generate(engine, prompt: list[int]) -> list[int]:
    return await generate_greedy(engine, prompt, NEW_TOKENS)


def test_every_drafter_reproduces_plain_greedy(tiny_llama_store):
    async def main():
        async with open_local_ring(tiny_llama_store, 3, engine=EngineConfig(draft="none")) as ring:
            engine = ring.engine
            plain = {tuple(p): await generate(engine, p) for p in PROMPTS}
            drafters = {
                "ngram": lambda: [NgramDrafter()],
                "noisy-chain": lambda: [NoisyOracleDrafter(plain, tree=False, seed=1)],
                "noisy-tree": lambda: [NoisyOracleDrafter(plain, tree=True, seed=2)],
                "hybrid-noisy": lambda: [NgramDrafter(), NoisyOracleDrafter(plain, tree=True, seed=4)],
            }
            stats = {}
            for name, make in drafters.items():
                engine.make_drafters = make
                for p in PROMPTS:
                    got = await generate(engine, p)
                    assert got == plain[tuple(p)], (name, p)
                stats[name] = True
            return stats

    assert trio.run(main) == {"ngram": True, "noisy-chain": True, "noisy-tree": True, "hybrid-noisy": True}


def test_speculation_commits_several_tokens_per_traversal(tiny_llama_store):
    # Not a speed target, a sanity check that the drafts are actually used: on a ring with
    # WAN-like latency (where the planner wants long drafts) a drafter that is right 70%
    # of the time must commit well over one token per traversal.
    async def main():
        async with open_local_ring(tiny_llama_store, 2, engine=EngineConfig(draft="none", link_latency_ms=20),
                                   node_config={"link_latency_ms": 20}) as ring:
            engine = ring.engine
            plain = {tuple(PROMPTS[0]): await generate(engine, PROMPTS[0])}
            engine.make_drafters = lambda: [NoisyOracleDrafter(plain, tree=True, seed=3)]
            return (await generate_greedy_with_stats(engine, PROMPTS[0], NEW_TOKENS))[1]

    stats = trio.run(main)
    assert stats["tokens_per_traversal"] > 1.5, stats


@pytest.mark.parametrize("accuracy", [0.97, 0.85])
def test_deep_pipelines_are_used_and_lossless(tiny_llama_store, accuracy):
    # Several rounds in flight, each built on all before it being accepted whole: a miss
    # (a wrong draft token or a wrong guess of the bonus token) must discard every round
    # after it, whichever of them the miss hits, and the next fresh round overwrites
    # their K/V slots. At 0.97 the planner keeps more than two rounds in flight; at 0.85
    # deep pipelines are often broken midway. A depth cap of 1 sends nothing ahead.
    tokens = 96

    async def main():
        async with open_local_ring(tiny_llama_store, 2, engine=EngineConfig(draft="none", link_latency_ms=8),
                                   node_config={"link_latency_ms": 8}) as ring:
            engine = ring.engine
            plain = {tuple(p): await generate_greedy(engine, p, tokens) for p in PROMPTS}
            runs = {}
            for depth, prompts in ((4, PROMPTS), (1, PROMPTS[:1])):
                engine.config = dataclasses.replace(engine.config, max_pipeline_depth=depth)
                for i, p in enumerate(prompts):
                    engine.make_drafters = lambda i=i: [NoisyOracleDrafter(plain, tree=False, seed=20 + i, accuracy=accuracy)]
                    runs[(depth, tuple(p))] = await generate_greedy_with_stats(engine, p, tokens)
                if depth > 1:
                    learned = engine.learned_adapt[1]
                    queue_s, traversal_s = learned.queue_s, learned.traversal.t
            return plain, runs, queue_s, traversal_s

    plain, runs, queue_s, traversal_s = trio.run(main)
    # Rounds sent behind others measured how long one delays the next: on this ring (three
    # 8 ms hops, tiny stages) less than a whole traversal of a round sent alone (the EWMA
    # the line is fitted to). Not the line's intercept: a loaded machine tilts the line
    # and has put the intercept below the links' own 24 ms.
    assert queue_s is not None and 0.0 <= queue_s < traversal_s, (queue_s, traversal_s)
    for (depth, p), (out, _) in runs.items():
        assert out == plain[p], (depth, p)
    deep = [stats for (depth, _), (_, stats) in runs.items() if depth == 4]
    assert any(s["planner"]["queue_ms"] is not None for s in deep), deep  # reported once measured
    assert sum(s["pipelined_rounds"] for s in deep) > 0, deep
    assert sum(s["pipelined_rounds_discarded"] for s in deep) > 0, deep
    if accuracy > 0.9:
        assert max(s["most_rounds_in_flight"] for s in deep) > 2, deep
    off = [stats for (depth, _), (_, stats) in runs.items() if depth == 1]
    assert all(s["pipelined_rounds"] == 0 and s["most_rounds_in_flight"] == 1 for s in off), off


def test_a_new_job_starts_from_what_finished_jobs_learned(tiny_llama_store):
    # A short request would spend most of its rounds unlearning the planner's priors, so
    # the engine hands each new job the acceptance and traversal times of the last finished
    # one; traversal times measured on another ring epoch must not carry over (another ring
    # is other links and other stages), acceptance does (same model, same drafter).
    async def main():
        async with open_local_ring(tiny_llama_store, 2, engine=EngineConfig(draft="none")) as ring:
            engine = ring.engine
            plain = {tuple(PROMPTS[0]): await generate(engine, PROMPTS[0])}
            assert engine.learned_adapt[1].rounds == 0  # plain decoding teaches the planner nothing
            engine.make_drafters = lambda: [NoisyOracleDrafter(plain, tree=False, seed=6)]
            await generate(engine, PROMPTS[0])
            epoch, learned = engine.learned_adapt
            job = await engine.open_job(PROMPTS[0], SamplingParams(temperature=0.0))
            await job.aclose()
            return epoch, ring.engine.swarm.ring.epoch, learned, job.adapt, engine.starting_adapt(epoch + 1)

    epoch, ring_epoch, learned, started, elsewhere = trio.run(main)
    assert epoch == ring_epoch and learned.rounds > 0 and learned.traversal is not None
    assert learned.acceptance[DraftSource("noisy")].tried > 0
    assert started is learned
    assert elsewhere.traversal is None and elsewhere.acceptance == learned.acceptance


class ConfidentNoisyDrafter(NoisyOracleDrafter):
    """The noisy oracle, reporting log-probs as a confident drafter (EAGLE does): the
    engine then drafts wide and prunes to the likeliest nodes, so accepted paths are cut
    out of trees whose nodes were renumbered."""

    name = "confident"
    confidence = True

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        tree = super().propose(context_ids, budget)
        logprobs = torch.tensor([-0.1 - self.rng.random() * (1 + i % 3) for i in range(tree.num_nodes)])
        return DraftTree(tree.tokens, tree.parents, logprobs=logprobs, source=DraftSource(self.name, str(tree.num_nodes)))


def random_eagle_head(store, path) -> None:
    """An untrained but confident EAGLE head for the tiny model: the real drafter, the aux
    rows the stages attach and the observe bookkeeping all run; its drafts are mostly wrong."""
    from coordinator.spec.eagle import EagleConfig, init_weights
    from coordinator.spec.eagle_train import save_head

    cfg = store.config
    g = torch.Generator().manual_seed(0)
    head_cfg = EagleConfig.for_target(cfg, (0, cfg.num_layers // 2, cfg.num_layers - 1), cfg.vocab_size)
    d2t = torch.arange(cfg.vocab_size)
    w = init_weights(head_cfg, store.load_embedding(), torch.ones(cfg.hidden_size), d2t, g)
    w["lm_head.weight"] *= 30  # peaky: the planner keeps drafts it is confident in
    save_head(path, head_cfg, w, d2t, target_digest=store.digest, dtype=torch.float32)


def test_confident_and_eagle_drafting_reproduce_plain_greedy(tiny_llama_store, tmp_path):
    # Guards the confidence planner's path through the engine (wide draft, likeliest
    # nodes kept, calibration) and EAGLE in the ring (aux rows from the stages, observe
    # after prefill chunks and verify rounds), alone and routed against n-gram or merged
    # with its draft (accepted paths then run through either drafter's nodes).
    random_eagle_head(tiny_llama_store, tmp_path / "head")

    async def main():
        config = EngineConfig(draft="eagle", eagle_head=str(tmp_path / "head"), link_latency_ms=10)
        async with open_local_ring(tiny_llama_store, 3, engine=config, node_config={"link_latency_ms": 10}) as ring:
            engine = ring.engine
            eagle_drafters = engine.make_drafters
            engine.make_drafters = lambda: []
            plain = {tuple(p): await generate(engine, p) for p in PROMPTS}
            modes = {
                "confident": lambda: [ConfidentNoisyDrafter(plain, tree=True, seed=6)],
                "confident+ngram": lambda: [NgramDrafter(), ConfidentNoisyDrafter(plain, tree=True, seed=7, accuracy=0.9)],
                "eagle": eagle_drafters,
                "eagle+ngram": lambda: [NgramDrafter(), *eagle_drafters()],
            }
            drafted = {}
            for name, make in modes.items():
                engine.make_drafters = make
                for p in PROMPTS:
                    got, stats = await generate_greedy_with_stats(engine, p, NEW_TOKENS)
                    assert got == plain[tuple(p)], (name, p)
                    for family, rounds in stats["draft_rounds"].items():
                        drafted[(name, family)] = drafted.get((name, family), 0) + rounds
                        # every round commits its accepted path plus the bonus token
                        assert stats["draft_round_tokens"][family] >= rounds, stats
            return drafted

    drafted = trio.run(main)
    assert drafted.get(("confident", "confident"), 0) > 0 and drafted.get(("eagle", "eagle"), 0) > 0, drafted
    # hybrid rounds that verified both drafters' trees merged into one
    assert drafted.get(("confident+ngram", "merged"), 0) > 0, drafted
