"""Families beyond the Llama layout through a real ring: greedy tokens equal transformers'
generate(), over a 3-stage in-process ring and over HTTP from `shard-coord serve`.

Guards the path outside the stage forward for a new family: the store the nodes load
slices from, the coordinator's output head (Gemma's (1 + w) final norm, tied embedding),
EAGLE-free plain decode over libp2p frames. The oracle is transformers' generate() on the
very model the store was prepared from, so the comparison is sound.
"""

from __future__ import annotations

import pytest
import torch
import trio

from coordinator.jobs.engine import IncrementalDetokenizer
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


def test_http_greedy_equals_generate(tiny_model_factory, tiny_store_factory, tmp_path):
    # The product path for a new family: `shard-coord serve --model <HF dir> --local-nodes 3`
    # and an OpenAI completions request carrying token ids. Sound: the reply's text and
    # token count equal transformers' greedy continuation put through the gateway's own
    # detokenizer (random tiny models emit partial UTF-8, whose text depends on where
    # decoding starts), a function of the tokens alone. On loopback the selector seats all
    # five layers on one node (fewest hops), so the split across stages is the in-process
    # test's; this one holds the CLI, store, gateway and HTTP path for the family.
    import os
    import re
    import subprocess
    import sys
    import time

    import httpx
    from transformers import AutoTokenizer

    tiny = tiny_model_factory("gemma3_text", **FAMILY_MODELS["gemma3_text"])
    store = tiny_store_factory(tiny)
    with torch.no_grad():
        ref = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)[0, len(PROMPT):].tolist()
    detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)), PROMPT)
    want = "".join(detok.push(t) for t in ref) + detok.flush()
    log_path = tmp_path / "coord.log"
    env = {**os.environ, "SHARD_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", "--model", str(tiny.path),
                                 "--store-dir", str(store.root), "--local-nodes", "3", "--http", "127.0.0.1:0",
                                 "--listen", "/ip4/127.0.0.1/tcp/0",
                                 "--draft", "none"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base, deadline = None, time.monotonic() + 120
        while base is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            m = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
            base = m.group(1) if m else None
        assert base is not None, log_path.read_text()[-3000:]
        r = httpx.post(f"{base}/v1/completions", json={"model": store.manifest.name, "prompt": PROMPT,
                                                       "max_tokens": NEW_TOKENS, "temperature": 0}, timeout=120)
        r.raise_for_status()
        data = r.json()
        assert data["usage"]["completion_tokens"] == NEW_TOKENS
        assert data["choices"][0]["text"] == want
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
