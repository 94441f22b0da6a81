"""Families beyond the Llama layout through a real 3-node ring: greedy tokens equal
transformers' generate().

Guards the path outside the stage forward for a new family: the store the nodes load
slices from, the coordinator's output head (Gemma's (1 + w) final norm, tied embedding),
EAGLE-free plain decode over libp2p frames. The oracle is transformers' generate() on the
very model the store was prepared from, so the comparison is sound.
"""

from __future__ import annotations

import pytest
import torch
import trio

from coordinator.jobs.engine_config import EngineConfig
from tests.e2e.ringkit import generate_greedy, open_local_ring

PROMPT = [1] + [3 + (11 * i) % 250 for i in range(19)]  # 20 tokens: past Gemma's 6-position window
NEW_TOKENS = 12
FAMILY_MODELS = {
    "gemma3_text": dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2, head_dim=16),
}


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_ring_greedy_equals_generate(family, tiny_model_factory, tiny_store_factory):
    tiny = tiny_model_factory(family, **FAMILY_MODELS[family])
    store = tiny_store_factory(tiny)
    with torch.no_grad():
        ref = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)[0, len(PROMPT):].tolist()

    async def main():
        async with open_local_ring(store, 3, engine=EngineConfig(draft="none")) as ring:
            assert len(ring.swarm.ring.stages) == 3  # every stage boundary is crossed on the wire
            return await generate_greedy(ring.engine, PROMPT, NEW_TOKENS)

    assert trio.run(main) == ref
