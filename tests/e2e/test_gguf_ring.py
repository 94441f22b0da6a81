"""A ring on a store that keeps a GGUF's quantised blocks (issue 22), end to end.

Guards the wiring around a kept-GGUF store: nodes started with the default `--quant none`
must run the store's int4 grids and say so (a node that registered "none" while running
int4 would be audited as f32 and sized by the wrong bytes), the selector must see their
bytes per layer, and the ring's greedy tokens must be those of the same quantised slice
run locally (the kernels are row-independent, so ring and local are bit-exact).
"""

from __future__ import annotations

import trio

from coordinator.jobs.engine_config import EngineConfig
from shard.quant import SCHEMES, mean_layer_bytes
from shard.store import prepare
from tests.e2e.ringkit import generate_greedy, open_local_ring
from tests.e2e.test_quant_ring import NEW_TOKENS, PROMPT, local_greedy
from tests.shard.test_gguf_store import write_gguf


def test_a_ring_on_a_kept_gguf_store_runs_its_int4_grids(tmp_path):
    store = prepare(write_gguf(tmp_path / "tiny-ring.gguf", "llama"), tmp_path / "store", progress=False).store
    assert store.manifest.quant == "int4"

    async def main():
        async with open_local_ring(store, 2, engine=EngineConfig(draft="none")) as ring:  # --quant none, the default
            regs = [m.register for m in ring.swarm.members.values()]
            assert {(r.quant, r.bytes_per_layer) for r in regs} == {("int4", mean_layer_bytes(store.config, SCHEMES["int4"]))}
            return await generate_greedy(ring.engine, PROMPT, NEW_TOKENS)

    assert trio.run(main) == local_greedy(store, "int4")
