"""Drafts respect the grammar on a real ring: a json_schema request with n-gram drafting, and
with n-gram and a (random) EAGLE head routed and merged (hybrid), over a 2-stage ring of the
tiny Llama, once with the drafts pruned to the grammar (the engine's default) and once with
the drafters unpruned, side by side.

Guards that, with a grammar, no drafted token the grammar forbids reaches the ring (every
verify frame's draft nodes are checked against a fresh matcher after the committed context),
and that the output is the same token for token either way. Sound because the unpruned run must
send forbidden tokens (the prompt shows spaced JSON, which n-gram drafts copy and the compact
grammar forbids), so the check would catch a filter that let them through; no round is sent
ahead (max_pipeline_depth=1), so every verify frame's root is a committed token.
"""

from __future__ import annotations

from contextlib import aclosing

import llguidance
import pytest
import torch
import trio
from transformers import AutoTokenizer

from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import prune
from coordinator.spec.grammar import json_constraint
from coordinator.spec.sampling import SamplingParams
from shard.ring_observer import RingObserver
from tests.e2e.ringkit import open_local_ring
from tests.e2e.test_spec_ring import random_eagle_head

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"], "additionalProperties": False}
PROMPT = 'records: {"name": "ada", "tags": ["x", "y"]} {"name": "bob", "tags": ["x", "y"]} {"name": "'
TOKENS = 48


class VerifyFrames(RingObserver):
    def __init__(self) -> None:
        self.frames: list[tuple[int, list[int], list[int]]] = []  # (root slot, tokens, frame parents)

    def round_sent(self, fwd) -> None:
        if fwd.phase == "verify":
            self.frames.append((int(fwd.positions[0]), fwd.tokens.tolist(), fwd.tree_parents.tolist()))


def forbidden_nodes(constraint, frames, all_tokens: list[int], prompt_len: int) -> tuple[int, int]:
    """(draft nodes sent, those the grammar forbids after their committed context and path)."""
    sent = bad = 0
    for root_slot, tokens, parents in frames:
        context = all_tokens[prompt_len: root_slot + 1]  # the completion up to and including the root
        for j in range(1, len(tokens)):
            path, k = [], j
            while k > 0:
                path.append(tokens[k])
                k = parents[k]
            matcher = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
            whole = context + path[::-1]
            sent += 1
            bad += matcher.validate_tokens(whole) < len(whole)
    return sent, bad


def accepted_lost(constraint, frames, all_tokens: list[int], prompt_len: int) -> int:
    """Verify frames of an unpruned run whose accepted path (the longest draft path that
    matches what was committed after its root) pruning would have cut short."""
    draft_filter, lost = constraint.draft_filter(), 0
    for root_slot, tokens, parents in frames:
        tree = DraftTree(torch.tensor(tokens[1:]), torch.tensor([p - 1 for p in parents[1:]]))
        draft_filter.sync(all_tokens[prompt_len: root_slot + 1])
        after = all_tokens[root_slot + 1:]

        def accepted(t: DraftTree) -> int:
            best = 0
            for path in t.paths():
                n = 0
                while n < len(path) and n < len(after) and int(t.tokens[path[n]]) == after[n]:
                    n += 1
                best = max(best, n)
            return best

        lost += accepted(prune(tree, draft_filter.allowed_prefix)) < accepted(tree)
    return lost


@pytest.mark.parametrize("draft", ["ngram", "hybrid"])
def test_pruned_drafts_never_carry_a_forbidden_token_and_change_no_output(tiny_llama_store, tmp_path, draft):
    store = tiny_llama_store
    random_eagle_head(store, tmp_path / "head")  # hybrid's EAGLE trees carry log-probs and probability rows
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    constraint = json_constraint(tokenizer, SCHEMA)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]

    async def generate(engine, prune: bool):
        engine.observer = seen = VerifyFrames()
        job = await engine.open_job(prompt, SamplingParams(temperature=0.0, constraint=constraint))
        if not prune:
            job.drafters = [d.inner for d in job.drafters]
        out: list[int] = []
        try:
            async with aclosing(job.next_tokens()) as blocks:
                async for block in blocks:
                    out += block
                    if tokenizer.eos_token_id in out or len(out) >= TOKENS:  # the gateway stops at the EOS
                        break
            stats = job.stats()
        finally:
            await job.aclose()
        end = out.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in out else TOKENS
        return out[:min(end, TOKENS)], stats, seen.frames

    async def main():
        with trio.fail_after(180):
            config = EngineConfig(draft=draft, eagle_head=str(tmp_path / "head"), max_pipeline_depth=1)
            async with open_local_ring(store, 2, engine=config) as ring:
                return await generate(ring.engine, True), await generate(ring.engine, False)

    (out, stats, frames), (raw_out, raw_stats, raw_frames) = trio.run(main)
    assert out == raw_out  # pruning never changes what is committed
    sent, bad = forbidden_nodes(constraint, frames, prompt + out, len(prompt))
    raw_sent, raw_bad = forbidden_nodes(constraint, raw_frames, prompt + raw_out, len(prompt))
    print(f"json_schema, {draft}, tiny Llama 2 stages, {TOKENS} tokens: pruned {stats['tokens_per_traversal']:.2f} "
          f"tokens/traversal, {sent} draft rows in {stats['traversals']} traversals ({bad} forbidden); unpruned "
          f"{raw_stats['tokens_per_traversal']:.2f} tokens/traversal, {raw_sent} draft rows in "
          f"{raw_stats['traversals']} traversals ({raw_bad} forbidden)")
    assert raw_bad > 0, "the unpruned drafts sent no forbidden token: the check below would prove nothing"
    assert bad == 0 and sent > 0
    # And pruning never cuts what the target accepted: every accepted path of the unpruned
    # run survives the filter (the other half of "the output is unchanged").
    assert accepted_lost(constraint, raw_frames, prompt + raw_out, len(prompt)) == 0
    # Tokens per traversal and rows are measured, not asserted: the planner sizes drafts by
    # measured traversal times, so both move from run to run (scripts/bench_grammar_drafts.py
    # compares them over repeated runs).
