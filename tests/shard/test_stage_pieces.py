"""A prefill chunk run in pieces beside other jobs' rows equals the chunk run alone.

Guards issue 21's "a long prompt does not stall everyone else's decode": a stage runs a
long prefill chunk as consecutive pieces (StageWorker.compute with `pieces`), one per
forward, each beside decode rows, verify chains and trees of other jobs. Bugs guarded: a
piece attending to the wrong rows (its context must be the earlier pieces' K/V, and on a
sliding layer only the window of it), rotary or slots off by the piece's start, the commit
applied twice, captured aux rows or the tail's last row taken from one piece instead of
the frame, a receipt signed per piece or over a piece, a failed piece leaving a half
frame that later pieces extend. Oracle: the same worker code run on each frame alone (whole)
over a twin cache with the same history (itself checked against transformers in
test_stage_exact / test_stage_families); a piece's attention reduces over fewer keys than
the whole chunk's, so equality is to the issue's 1e-4 in fp32, not bitwise.
"""

from __future__ import annotations

import pytest
import torch

from shard.errors import CacheFullError
from shard.stage import StageInputError
from shard.stage_worker import StageWorker, WorkerConfig, splittable
from shard.wire.codec import decode_frame, encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Forward, Result
from tests.shard.test_stage_batch import BUILDERS, TREE
from tests.shard import test_stage_exact as exact

TOL = 1e-4


@pytest.fixture(scope="module", params=list(BUILDERS))
def stages(request, tmp_path_factory):
    return BUILDERS[request.param](tmp_path_factory)


def fwd(job: str, tokens, ctx: int, phase: str = "prefill", positions=None, parents=None, commit=((), 0),
        aux=()) -> Forward:
    tokens = torch.as_tensor(tokens)
    positions = torch.arange(ctx, ctx + len(tokens)) if positions is None else torch.as_tensor(positions)
    return Forward(job_id=job, epoch=1, round=1, nonce=bytes(16), phase=phase, ctx_len=ctx, positions=positions,
                   tokens=tokens, tree_parents=parents, commit_src=tuple(commit[0]), commit_dst=commit[1],
                   want_aux_layers=tuple(aux))


class Twin:
    """One worker per stage (a ring's slices in one process), is_tail off so every row
    comes back; frames go through every stage."""

    def __init__(self, cfg, stages, **worker) -> None:
        self.workers = [StageWorker(s, WorkerConfig(**worker)) for s in stages]

    def alone(self, frames: list[Forward]) -> dict[str, Forward]:
        out = {}
        for f in frames:
            for w in self.workers:
                [f] = w.compute([f])
                assert isinstance(f, Forward), f
            out[f.job_id] = f
        return out

    def split(self, chunk: Forward, cuts: list[list[int]], others: list[list[Forward]]) -> dict[str, Forward]:
        """Run `chunk` through each stage s in pieces of sizes cuts[s], piece k in one forward
        with the frames others[k] (other jobs' frames, at stage 0's input)."""
        xs = [list(fs) for fs in others]  # each other frame as the next stage takes it
        x = chunk
        for s, w in enumerate(self.workers):
            start = 0
            for k, n in enumerate(cuts[s]):
                outs = w.compute([x, *xs[k]], [(start, start + n)] + [None] * len(xs[k]))
                start += n
                assert all(isinstance(o, Forward) for o in outs[1:]), outs
                xs[k] = outs[1:]
                if start < chunk.positions.shape[0]:
                    assert outs[0] is None and x.job_id in w.pieces  # rows left: nothing to send yet
            assert isinstance(outs[0], Forward) and x.job_id not in w.pieces
            x = outs[0]
        return {f.job_id: f for fs in xs for f in fs} | {chunk.job_id: x}  # a job's last frame


def ids(g, n, vocab):
    return torch.randint(3, vocab, (n,), generator=g)


def assert_close(got: Forward, want: Forward, name: str) -> None:
    assert got.hidden.shape == want.hidden.shape, name
    assert (got.hidden.float() - want.hidden.float()).abs().max().item() <= TOL, name
    if want.aux is not None:
        assert (got.aux.float() - want.aux.float()).abs().max().item() <= TOL, name


def test_a_chunk_in_pieces_beside_other_jobs_equals_it_alone(stages):
    cfg, stage_list = stages
    one, many = Twin(cfg, stage_list), Twin(cfg, stage_list)
    g = torch.Generator().manual_seed(5)
    v = cfg.vocab_size
    history = [fwd("p", ids(g, 12, v), 0), fwd("q", ids(g, 3, v), 0), fwd("d", ids(g, 5, v), 0),
               fwd("c", ids(g, 9, v), 0), fwd("t", ids(g, 3, v), 0)]
    one.alone(history), many.alone(history)
    last = stage_list[-1].layers.end - 1
    chunk = fwd("p", ids(g, 76, v), 12, aux=(1, last))  # continues p's prompt; aux rows captured per piece
    fresh = fwd("q2", ids(g, 40, v), 0)  # slot 0: the whole chunk takes SDPA's causal path, pieces a mask
    others = [[fwd("d", ids(g, 1, v), 5, "decode")],
              [fwd("c", ids(g, 4, v), 9, "verify")],  # a chain
              [fwd("t", ids(g, 6, v), 3, "verify", positions=[3 + d for d in (0, 1, 1, 2, 2, 2)],
                   parents=torch.tensor(TREE, dtype=torch.int32))],
              [fwd("q", ids(g, 7, v), 3)]]  # another job's short prefill chunk
    cuts = [[1, 7, 64, 4], [64, 1, 7, 4]]  # each stage cuts its own way
    got = many.split(chunk, cuts, others)
    want = one.alone([chunk] + [f for fs in others for f in fs])
    for name, w in want.items():
        assert_close(got[name], w, name)
    got = many.split(fresh, [[7, 33], [39, 1]], [[], []])
    assert_close(got["q2"], one.alone([fresh])["q2"], "q2")
    # The K/V the pieces wrote is the chunk's own: the next rows still match alone.
    after = [fwd("p", ids(g, 1, v), 88, "decode"), fwd("q2", ids(g, 2, v), 40, "verify"),
             fwd("t", ids(g, 1, v), 6, "decode", commit=([3, 5, 8], 3))]
    got, want = many.alone(after), one.alone(after)
    for name, w in want.items():
        assert_close(got[name], w, name)


def test_a_failing_piece_fails_its_job_alone():
    """Cache full mid-chunk: the piece that would grow past the job's slots gets its own
    CacheFullError, the rows beside it equal alone, and no half frame stays to extend."""
    model = exact.make_model("llama")
    ring = exact.Ring(model, 1)
    g = torch.Generator().manual_seed(6)
    v = ring.cfg.vocab_size
    # 0 context tokens: each job may hold DRAFT_SLACK_SLOTS (128) slots.
    one, many = Twin(ring.cfg, ring.stages, max_context_tokens=0), Twin(ring.cfg, ring.stages, max_context_tokens=0)
    warm = [fwd("d", ids(g, 5, v), 0)]
    one.alone(warm), many.alone(warm)
    chunk = fwd("p", ids(g, 150, v), 0)
    rows = [fwd("d", ids(g, 1, v), 5 + k, "decode") for k in range(3)]
    [w] = many.workers
    for k, piece in enumerate([(0, 64), (64, 128), (128, 150)]):
        outs = w.compute([chunk, rows[k]], [piece, None])
        assert (outs[0] is None) == (k < 2), outs[0]
        assert_close(outs[1], one.alone([rows[k]])["d"], f"d{k}")
    assert isinstance(outs[0], CacheFullError) and "p" not in w.pieces
    # Should a later piece come anyway, it is refused: it would extend a frame that failed.
    [late] = w.compute([chunk], [(128, 150)])
    assert isinstance(late, StageInputError)


def test_process_frames_signs_the_whole_frame_once(tiny_llama_store):
    """Receipts and the tail: the frame's output is sent once, after its last piece, signed
    over the whole frame's received bytes; the tail's prefill row is the frame's last, and
    the aux rows cover every row of the frame."""
    from shard.layers import LayerRange
    from shard.stage import Stage

    store = tiny_llama_store
    r = LayerRange(0, store.num_layers)
    stage = Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding())
    signed = []

    def signer(f, received, body):
        signed.append((f.job_id, bytes(received), body))
        return b"receipt"

    split = StageWorker(stage, WorkerConfig(is_tail=True), signer)
    whole = StageWorker(stage, WorkerConfig(is_tail=True))
    chunk = fwd("p", list(range(5, 25)), 0, aux=(0, store.num_layers - 1))
    raw = encode_body(chunk)
    assert split.process_frames([(chunk, raw)], [(0, 6)]) == [None] and signed == []
    [(msg, body)] = split.process_frames([(chunk, raw)], [(6, 20)])
    assert [(j, rec) for j, rec, _ in signed] == [("p", raw)]  # once, over the whole frame's bytes
    assert isinstance(msg, Result) and msg.receipts == (b"receipt",) and body.startswith(signed[0][2])
    decoded, canonical_len = decode_frame(body, Limits())
    assert torch.equal(decoded.hidden, msg.hidden) and canonical_len == len(signed[0][2])
    want = whole.process(chunk)
    assert msg.hidden.shape == want.hidden.shape == (1, store.config.hidden_size)  # the frame's last row
    assert msg.aux.shape == want.aux.shape == (20, 2 * store.config.hidden_size)  # every row's features
    assert (msg.hidden.float() - want.hidden.float()).abs().max().item() <= TOL
    assert (msg.aux.float() - want.aux.float()).abs().max().item() <= TOL


def test_which_frames_run_in_pieces(tiny_llama_store):
    from shard.layers import LayerRange
    from shard.stage import Stage

    store = tiny_llama_store
    r = LayerRange(0, 1)
    w = StageWorker(Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding()), WorkerConfig())
    h = store.config.hidden_size
    assert w.queued_rows(fwd("p", [5, 6, 7], 4)) == (3, h * 4)
    assert w.queued_rows(fwd("p", [5, 6, 7], 4, aux=(0, 3))) == (3, 2 * h * 4)  # layer 0's rows kept too
    assert w.queued_rows(fwd("p", [5], 4)) == (1, 0)  # one row: nothing to cut
    assert w.queued_rows(fwd("p", [5, 6], 4, "verify")) == (2, 0)  # a chain to verify runs whole
    assert not splittable(fwd("p", [5, 6, 7], 4, positions=[4, 5, 7]))  # slots would not follow positions
    assert not splittable(fwd("t", [5, 6, 7], 4, parents=torch.tensor([-1, 0, 0], dtype=torch.int32)))
    [bad] = w.compute([fwd("t", [5, 6], 2, "verify")], [(0, 1)])
    assert isinstance(bad, StageInputError)  # the worker refuses to cut what it may not


@pytest.mark.slow
def test_smollm2_logits_of_a_chunk_in_pieces_equal_it_alone(smollm2_store):
    """The real default model, two stages of 15 layers: hidden states reach ~1e3, so a
    piece's attention over fewer keys shows in the last bits (not bitwise, unlike a batch
    of whole frames: test_stage_batch_smollm2), but every row's logits stay within 1e-4."""
    from shard.layers import LayerRange
    from shard.stage import OutputHead, Stage

    store = smollm2_store
    cfg = store.config
    half = cfg.num_layers // 2
    stage_list = [Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding() if r.start == 0 else None)
                  for r in (LayerRange(0, half), LayerRange(half, cfg.num_layers))]
    norm, lm_head = store.load_head()
    head = OutputHead(cfg, norm, lm_head if lm_head is not None else store.load_embedding())
    one, many = Twin(cfg, stage_list), Twin(cfg, stage_list)
    g = torch.Generator().manual_seed(7)
    v = cfg.vocab_size
    history = [fwd("p", ids(g, 20, v), 0), fwd("d", ids(g, 30, v), 0), fwd("c", ids(g, 9, v), 0), fwd("t", ids(g, 3, v), 0)]
    one.alone(history), many.alone(history)
    chunk = fwd("p", ids(g, 150, v), 20)
    others = [[fwd("d", ids(g, 1, v), 30, "decode")], [fwd("c", ids(g, 4, v), 9, "verify")],
              [fwd("t", ids(g, 6, v), 3, "verify", positions=[3 + d for d in (0, 1, 1, 2, 2, 2)],
                   parents=torch.tensor(TREE, dtype=torch.int32))], [fwd("d", ids(g, 1, v), 31, "decode")]]
    got = many.split(chunk, [[1, 7, 64, 78], [64, 64, 21, 1]], others)
    want = one.alone([chunk] + [f for fs in others for f in fs])
    for name, w in want.items():
        diff = (head.logits(got[name].hidden) - head.logits(w.hidden)).abs().max().item()
        assert diff <= 1e-4, (name, diff)
    after = [fwd("p", ids(g, 1, v), 170, "decode")]
    diff = (head.logits(many.alone(after)["p"].hidden) - head.logits(one.alone(after)["p"].hidden)).abs().max().item()
    assert diff <= 1e-4, diff
