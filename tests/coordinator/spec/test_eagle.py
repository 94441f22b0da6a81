"""EAGLE head and drafter: cached forward, observe/propose bookkeeping, tree shape, and
the shipped head's digest check. A tiny random head (no training) is enough for all but
the slow test, which drafts with the shipped head against SmolLM2's greedy output."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget
from coordinator.spec.eagle import EagleConfig, EagleDraftConfig, EagleDrafter, EagleHead, PairCache, init_weights, shipped_head_dir
from coordinator.spec.eagle_train import save_head
from coordinator.spec.source import DraftSource
from coordinator.errors import EagleHeadError
from shard.arch import ModelConfig

TARGET = ModelConfig(model_type="llama", num_layers=6, hidden_size=32, intermediate_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=8, vocab_size=96, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=False)
AUX = (1, 3, 5)


def tiny_head(seed: int = 0, draft_vocab: int = 40) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    cfg = EagleConfig.for_target(TARGET, AUX, draft_vocab)
    embedding = torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g)
    d2t = torch.randperm(TARGET.vocab_size, generator=g)[:draft_vocab].sort().values
    w = init_weights(cfg, embedding, torch.ones(TARGET.hidden_size), d2t, g)
    # Random weights 10x larger than the init, so the head's outputs depend visibly on
    # every input (a near-identity head would hide cache bugs).
    w = {n: (t * 10 if t.dim() == 2 and n != "lm_head.weight" else t) for n, t in w.items()}
    return EagleHead(cfg, TARGET, w, d2t, embedding)


def aux_rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, len(AUX) * TARGET.hidden_size, generator=torch.Generator().manual_seed(seed))


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.allclose(a.logprobs, b.logprobs)


def test_cached_forward_equals_uncached():
    # Guards the KV cache: pairs written in three chunks (at slots 0, 5, 6) must give the
    # same outputs as one causal pass over all of them, or drafts drift as context grows.
    head = tiny_head()
    n = 9
    feat = torch.randn(n, TARGET.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, TARGET.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(1, n + 1)
    whole = head.forward(PairCache(head.config), feat, tokens, pos, 0)
    cache = PairCache(head.config)
    parts = [head.forward(cache, feat[a:b], tokens[a:b], pos[a:b], a) for a, b in ((0, 5), (5, 6), (6, 9))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


def test_observe_in_rounds_equals_observe_at_once():
    # Guards observe's pair bookkeeping: the first pair of a round needs the previous
    # round's last feature; dropping or duplicating it changes the committed cache.
    ids = torch.randint(0, TARGET.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    aux = aux_rows(12, 4)
    once, rounds = EagleDrafter(tiny_head()), EagleDrafter(tiny_head())
    once.observe(ids[:11], aux[:11])
    for a, b in ((0, 6), (6, 7), (7, 11)):
        rounds.observe(ids[a:b], aux[a:b])
    assert rounds._committed_pairs == once._committed_pairs == 10
    torch.testing.assert_close(rounds.cache.k[:, :10], once.cache.k[:, :10], rtol=1e-5, atol=1e-5)
    budget = DraftBudget(12, 4)
    assert same_tree(once.propose(ids, budget), rounds.propose(ids, budget))


def test_propose_is_repeatable_and_discards_speculative_kv():
    # Guards rollback: drafting writes tree pairs after the committed slots; a second
    # draft from the same state, or one after a commit, must not see them.
    drafter = EagleDrafter(tiny_head())
    ids = [5, 17, 3, 44, 9, 71]
    aux = aux_rows(6, 5)
    drafter.observe(ids[:5], aux[:5])
    committed = drafter.cache.k[:, :4].clone()
    first = drafter.propose(ids, DraftBudget(10, 4))
    second = drafter.propose(ids, DraftBudget(10, 4))
    assert same_tree(first, second)
    assert torch.equal(drafter.cache.k[:, :4], committed)
    # A drafter that never drafted, observing the same continuation, agrees afterwards.
    drafter.observe(ids[5:6], aux[5:6])
    clean = EagleDrafter(tiny_head())
    clean.observe(ids, aux)
    ctx = ids + [30]
    assert same_tree(drafter.propose(ctx, DraftBudget(10, 4)), clean.propose(ctx, DraftBudget(10, 4)))


def test_trees_are_well_formed_and_keep_the_likeliest_paths():
    head = tiny_head()
    drafter = EagleDrafter(head)
    ids = [1, 2, 3, 4, 5]
    drafter.observe(ids[:4], aux_rows(4, 6))
    tree = drafter.propose(ids, DraftBudget(12, 3))
    assert tree.num_nodes == 12 and tree.max_depth <= 3 and tree.source == DraftSource("eagle", "tree")
    assert set(tree.tokens.tolist()) <= set(head.d2t.tolist())
    for node in range(-1, tree.num_nodes):
        kids = [int(tree.tokens[c]) for c in tree.children(node)]
        assert len(kids) == len(set(kids))  # siblings differ, so a path names one node
        assert float(torch.exp(tree.logprobs[list(tree.children(node))]).sum()) <= 1.0 + 1e-6
    chain = drafter.propose(ids, DraftBudget.chain(4))
    assert chain.source == DraftSource("eagle", "chain") and chain.parents.tolist() == [-1, 0, 1, 2]


def _path_logprobs(head: EagleHead, ids: list[int], aux: torch.Tensor, path: list[int]) -> torch.Tensor:
    """Reference: the head's log-probs after `path` below the root ids[-1], run one pair
    at a time on a private copy of the committed cache (plain causal attention)."""
    d = EagleDrafter(head)
    d.observe(ids[:-1], aux)
    at, pos = d._committed_pairs, len(ids) - 1
    g = head.forward(d.cache, d._last_feat[None], torch.tensor([ids[-1]]), torch.tensor([pos]), at)
    for j, tok in enumerate(path):
        g = head.forward(d.cache, g, torch.tensor([tok]), torch.tensor([pos + 1 + j]), at + 1 + j)
    return torch.log_softmax(head.logits(g[0]), dim=-1)


def test_level_batched_tree_equals_the_best_paths_found_one_pair_at_a_time():
    # Guards the batched drafting: one head forward per depth, with per-row ancestor
    # masks over shared speculative slots. With a beam wide enough, the tree must be
    # exactly the m likeliest paths (top-3 children per node, depth 3), each path's
    # log-probs computed here by running its pairs one at a time on a private cache.
    head = tiny_head(seed=4)
    ids = [3, 14, 15, 92, 65, 35]
    aux = aux_rows(5, 13)
    drafter = EagleDrafter(head, EagleDraftConfig(top_k=3, beam=12))
    drafter.observe(ids[:-1], aux)
    tree = drafter.propose(ids, DraftBudget(12, 3))
    found = []  # (cumulative log-prob, path tokens, own log-prob), every node to depth 3
    frontier = [((), 0.0)]
    for _ in range(3):
        nxt = []
        for path, cum in frontier:
            logp = _path_logprobs(head, ids, aux, list(path))
            top = torch.topk(logp, 3)
            for tok, lp in zip(head.d2t[top.indices].tolist(), top.values.tolist()):
                found.append((cum + lp, path + (tok,), lp))
                nxt.append((path + (tok,), cum + lp))
        frontier = nxt
    best = sorted(found, key=lambda f: -f[0])[:12]
    got = {tuple(tree.path_tokens(i)): float(tree.logprobs[i]) for i in range(tree.num_nodes)}
    assert set(got) == {path for _, path, _ in best}
    for _, path, lp in best:
        assert got[path] == pytest.approx(lp, abs=1e-4)


def test_chain_follows_the_heads_argmax_from_the_root():
    # Guards the root step: the first draft token must come from (last observed
    # feature, root embedding) at the root's position, which is what training taught.
    head = tiny_head()
    drafter = EagleDrafter(head)
    ids = [7, 8, 9, 10]
    aux = aux_rows(3, 7)
    drafter.observe(ids[:3], aux)
    chain = drafter.propose(ids, DraftBudget.chain(1))
    ref = tiny_head()
    feat = torch.nn.functional.linear(aux, ref.w["fc.weight"])  # (3, H)
    g = ref.forward(PairCache(ref.config), feat, torch.tensor(ids[1:4]), torch.arange(1, 4), 0)  # pairs at positions 1..3
    want = int(ref.d2t[ref.logits(g[-1]).argmax()])
    assert chain.tokens.tolist() == [want]


def test_drafts_carry_the_drafters_name_as_their_source_family():
    # Bug guarded: the engine plans each drafter by the acceptance of `drafter.name`;
    # without one, EAGLE was planned by the pooled acceptance of every drafter (n-gram's).
    drafter = EagleDrafter(tiny_head())
    drafter.observe([1, 2, 3], aux_rows(3, 9))
    sources = {drafter.propose([1, 2, 3, 4], budget).source for budget in (DraftBudget(4, 4), DraftBudget(8, 3))}
    sources.add(drafter.propose([1, 2], DraftBudget(4, 4)).source)  # unsynced: empty
    assert {s.family for s in sources} == {drafter.name} == {"eagle"}


def test_unsynced_context_gives_an_empty_draft():
    drafter = EagleDrafter(tiny_head())
    assert drafter.propose([1, 2], DraftBudget(4, 4)).num_nodes == 0  # nothing observed
    drafter.observe([1, 2, 3], aux_rows(3, 8))
    assert drafter.propose([1, 2, 3, 4, 5], DraftBudget(4, 4)).num_nodes == 0  # two tokens unobserved
    assert drafter.propose([1, 2, 9, 4], DraftBudget(4, 4)).num_nodes == 0  # diverged history
    assert drafter.propose([1, 2, 3, 4], DraftBudget(4, 4)).num_nodes == 4
    with pytest.raises(ValueError, match=r"observe needs aux of shape \(2, 96\), got \(2, 95\)"):
        drafter.observe([4, 5], torch.zeros(2, 95))


def test_saved_head_round_trips_and_a_corrupted_copy_is_refused(tmp_path: pathlib.Path):
    head = tiny_head()
    save_head(tmp_path / "h", head.config, head.w, head.d2t, target_digest="abc", dtype=torch.float32)
    loaded = EagleHead.load(tmp_path / "h", TARGET, head.embedding, target_digest="abc")
    assert loaded.config == head.config and torch.equal(loaded.d2t, head.d2t)
    with pytest.raises(EagleHeadError, match="target model digest: expected other, got abc"):
        EagleHead.load(tmp_path / "h", TARGET, head.embedding, target_digest="other")
    weights = tmp_path / "h" / "eagle3.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(EagleHeadError, match="sha256"):
        EagleHead.load(tmp_path / "h", TARGET, head.embedding)


def test_shipped_head_manifest_matches_its_weights(tmp_path: pathlib.Path):
    # The shipped head's digest must verify, and a flipped byte must be refused, without
    # loading the 135M target (a stand-in embedding of the right shape suffices).
    root = shipped_head_dir("smollm2-135m")
    assert root is not None, "coordinator/spec/heads/smollm2-135m is missing"
    manifest = json.loads((root / "manifest.json").read_text())
    c = manifest["config"]
    target = ModelConfig(model_type="llama", num_layers=30, hidden_size=c["hidden_size"],
                         intermediate_size=c["intermediate_size"], num_heads=c["num_heads"],
                         num_kv_heads=c["num_kv_heads"], head_dim=c["head_dim"], vocab_size=49152,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, qkv_bias=False)
    embedding = torch.zeros(49152, c["hidden_size"])
    head = EagleHead.load(root, target, embedding, target_digest=manifest["target_digest"])
    assert head.config.aux_layers == tuple(manifest["config"]["aux_layers"])
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    data = bytearray((copy / "eagle3.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x40
    (copy / "eagle3.safetensors").write_bytes(bytes(data))
    with pytest.raises(EagleHeadError, match="sha256"):
        EagleHead.load(copy, target, embedding)


def test_training_unroll_matches_drafting():
    # Guards train/serve skew: step s of the training-time-test unroll at index i must be
    # exactly what drafting computes at depth s-1 below the root at index i-s+1 (true
    # features up to the root, then the head's own outputs along the path).
    from coordinator.spec.eagle_train import ttt_forward

    head = tiny_head(seed=3)
    n = 10
    ids = torch.randint(0, TARGET.vocab_size, (n,), generator=torch.Generator().manual_seed(9))
    aux = aux_rows(n, 10)
    steps = ttt_forward(head.w, head.config, TARGET.rms_norm_eps, head.rotary, head.embedding, ids[None], aux[None], 3)
    feat = torch.nn.functional.linear(aux, head.w["fc.weight"])  # (n, H)
    for s in (1, 2, 3):
        for i in range(s - 1, n - 1):
            root = i - s + 1  # index of the root pair (feature root, token root+1)
            cache = PairCache(head.config)
            g = head.forward(cache, feat[:root + 1], ids[1:root + 2], torch.arange(1, root + 2), 0)[-1]
            for depth in range(1, s):
                j = root + depth
                g = head.forward(cache, g[None], ids[j + 1:j + 2], torch.tensor([j + 1]), j)[0]
            torch.testing.assert_close(steps[s - 1][0, i], head.logits(g), rtol=1e-4, atol=1e-4)


def test_soft_labels_line_up_with_the_greedy_labels_and_reduce_to_them():
    # Guards a shifted soft target: at every index the target's distribution over the draft
    # vocabulary must be the one whose argmax is that index's greedy label, for each of two
    # sequences padded into one batch; and a one-hot target must give the greedy loss.
    from coordinator.spec.eagle_train import collate, soft_targets, step_losses

    gen = torch.Generator().manual_seed(4)
    vocab, hidden = 40, 8
    lm_head = torch.randn(vocab, hidden, generator=gen)
    seqs = []
    for n in (9, 6):
        final = torch.randn(n, hidden, generator=gen).half()
        seqs.append({"ids": torch.randint(0, vocab, (n,), generator=gen), "feats": torch.zeros(n, 3 * hidden).half(),
                     "labels": (final.float() @ lm_head.T).argmax(-1), "final": final})
    d2t = torch.unique(torch.cat([s["labels"] for s in seqs]))
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    _, _, labels, final = collate(seqs, t2d, 512)
    target_p = soft_targets(final, lm_head[d2t])
    keep = labels >= 0
    assert keep.sum() == 8 + 5
    assert torch.equal(target_p.argmax(-1)[keep], labels[keep])
    logits = [torch.randn(*labels.shape, len(d2t), generator=gen) for _ in range(3)]
    one_hot = torch.nn.functional.one_hot(labels.clamp(min=0), len(d2t)).float()
    greedy, _ = step_losses(logits, labels)
    assert float(step_losses(logits, labels, one_hot)[0]) == pytest.approx(float(greedy), rel=1e-5)
    assert float(step_losses(logits, labels, target_p)[0]) != pytest.approx(float(greedy), rel=1e-3)


@pytest.mark.slow
def test_shipped_head_drafts_smollm2_chains_above_plain_decoding(smollm2_store):
    # The engine's loop in miniature, on our stage runtime: prefill captures the aux
    # layers for every prompt row; each verify round feeds root + chain, accepts greedily,
    # and observes the root and accepted rows. Guards that the shipped head is trained for
    # this target and wired the way the engine drives it (a mis-shifted feature or
    # position drops tau to ~1.0). Prompts are not in the training set. The shipped head
    # measures 1.38 here (docs/eagle.md; the previous head 1.31): the floor is set to catch
    # wiring bugs, not to claim a target.
    from transformers import AutoTokenizer

    from coordinator.spec.accept import accept_greedy
    from shard.kvcache import KVCache
    from shard.layers import LayerRange
    from shard.stage import OutputHead, Stage

    store = smollm2_store
    cfg = store.config
    emb = store.load_embedding()
    norm, lm_head = store.load_head()
    out_head = OutputHead(cfg, norm, lm_head if lm_head is not None else emb)
    stage = Stage(cfg, LayerRange(0, cfg.num_layers), store.load_layers(LayerRange(0, cfg.num_layers)), embedding=emb)
    head = EagleHead.load(shipped_head_dir("smollm2-135m"), cfg, emb, target_digest=store.digest)
    tok = AutoTokenizer.from_pretrained(store.tokenizer_dir)
    # One open-ended, one code, one grounded prompt (the benchmark's mix); none is in the
    # training set, and the passage is new.
    passage = ("The canal was dug between 1790 and 1796 to carry coal from the valley mines to the port. "
               "Horses towed the barges along a path beside the water, and a lock keeper lived at each of "
               "the twelve locks. The railway took most of its trade after 1850, and the last cargo boat "
               "passed in 1931. Volunteers reopened the canal for pleasure boats in 1974.")
    prompts = ["Explain why the sky is blue in a short paragraph.",
               "Write a Python function that returns the sum of the squares of a list of numbers.",
               f"Summarise the following passage in two sentences.\n\n{passage}"]
    generated = rounds = 0
    per_prompt = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat).input_ids  # as the training data was tokenised
        job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 30).open("j", 512)
        h, cap = stage.forward(job, torch.tensor(ids), ctx_len=0, positions=torch.arange(len(ids)), capture=head.config.aux_layers)
        drafter = EagleDrafter(head)
        drafter.observe(ids, torch.cat([cap[layer] for layer in head.config.aux_layers], dim=-1))
        committed = ids + [int(out_head.logits(h[-1:]).argmax())]
        start = len(committed)
        while len(committed) < start + 48:
            tree = drafter.propose(committed, DraftBudget.chain(5))
            root = len(committed) - 1
            feed = torch.tensor([committed[root], *tree.tokens.tolist()])
            h, cap = stage.forward(job, feed, ctx_len=root, positions=torch.arange(root, root + len(feed)),
                                   capture=head.config.aux_layers)
            acc = accept_greedy(tree, out_head.logits(h))
            rows = [0, *(n + 1 for n in acc.nodes)]  # the root and the accepted chain prefix, in place
            drafter.observe([committed[root], *(int(tree.tokens[n]) for n in acc.nodes)],
                            torch.cat([cap[layer][rows] for layer in head.config.aux_layers], dim=-1))
            committed += list(acc.tokens)
            rounds += 1
        generated += len(committed) - start + 1  # the prefill's token came from its own traversal
        rounds += 1
        per_prompt.append(round(generated / rounds, 2))
    assert generated / rounds > 1.2, f"tau {generated / rounds:.2f} (running, per prompt: {per_prompt})"


def test_requests_sharing_a_head_do_not_share_kv():
    # Guards concurrency: the engine loads one head per model and a drafter per job;
    # one job's pairs must never be visible to another's drafts.
    head = tiny_head()
    a, b, alone = EagleDrafter(head), EagleDrafter(head), EagleDrafter(tiny_head())
    a.observe([1, 2, 3, 4], aux_rows(4, 11))
    b.observe([9, 8, 7], aux_rows(3, 12))
    alone.observe([9, 8, 7], aux_rows(3, 12))
    a.propose([1, 2, 3, 4, 5], DraftBudget(8, 3))
    assert same_tree(b.propose([9, 8, 7, 6], DraftBudget(8, 3)), alone.propose([9, 8, 7, 6], DraftBudget(8, 3)))


def test_nodes_below_the_confidence_floor_are_not_expanded():
    # Guards drafting time: with a floor no path can reach, only the root is expanded
    # (one head forward), so the draft is its top-k children; with no floor it goes deep.
    drafter = EagleDrafter(tiny_head(), EagleDraftConfig(top_k=4))
    ids = [2, 7, 1, 8, 2, 8]
    drafter.observe(ids[:-1], aux_rows(5, 14))
    floored = drafter.propose(ids, DraftBudget(16, 5, min_logprob=0.0))
    assert floored.num_nodes == 4 and floored.max_depth == 1
    assert drafter.propose(ids, DraftBudget(16, 5)).max_depth > 1
