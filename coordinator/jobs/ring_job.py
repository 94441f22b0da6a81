"""One request on the ring: verify rounds, their drafts, pipelined rounds, and resume.

A RingJob brings the ring's K/V up to its committed tokens and runs one verify round per
traversal (the root plus a draft; the accepted path and bonus token come back as one
block), keeps up to the planner's pipeline depth of rounds in flight when chains are
likely to be accepted whole, hands the drafters what they observe, and starts over on
whichever ring is current when its ring changes. It receives through its own channel
from the RingEngine, which owns the streams.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import trio

from receipts import sha256_digest
from coordinator.errors import JobFailedError, RingLost
from coordinator.trust.receipt_check import JobReceipts
from coordinator.spec import adapt
from coordinator.spec.accept import GreedyRows, accept_as_committed, accept_greedy_lazy, accept_sampling
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.draft_round import draft_ahead, draft_round, is_confident
from coordinator.spec.drafting import Drafter
from coordinator.jobs.prefill import prefill_chunks
from coordinator.spec.sampling import SamplingParams, make_generator, probs
from coordinator.swarm.swarm import RingState
from coordinator.swarm.topology import Traversal
from shard.activations import from_wire
from shard.transport import TransportError
from shard.wire.codec import encode_body, encode_trailer
from shard.wire.messages import EndJob, Forward, JobError, Result

if TYPE_CHECKING:
    from coordinator.jobs.ring_engine import RingEngine

log = logging.getLogger("shard.coordinator")



@dataclass(frozen=True)
class Arrived:
    """A Result from the tail, with the SHA-256 of its canonical bytes as received (what
    the tail's receipt must name as its output; b"" when receipts are off)."""

    result: Result
    digest: bytes


@dataclass(frozen=True)
class Ahead:
    """A round sent before the one it builds on was verified (pipelined speculation)."""

    round: int
    epoch: int
    tree: DraftTree  # its draft chain, below `root`
    root: int  # slot (= position) of its root token
    root_token: int  # the bonus token it assumed the previous round would commit
    sent_s: float
    draft_s: float
    queued_behind: float  # rounds of this job in flight ahead of it when sent (adapt.queued_share)


@dataclass
class RingJob:
    engine: RingEngine
    job_id: str
    prompt_ids: list[int]
    params: SamplingParams
    inbox: trio.MemoryReceiveChannel
    nonce: bytes = field(default_factory=lambda: os.urandom(16))
    committed: list[int] = field(default_factory=list)
    ring_ctx: int = 0  # tokens of `committed` whose K/V the ring holds (for ring_epoch)
    ring_epoch: int = -1
    round: int = 0
    traversals: int = 0
    resumes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    closed: bool = False
    drafters: list[Drafter] = field(default_factory=list)
    adapt: adapt.AdaptState = field(default_factory=adapt.AdaptState)
    pending_commit: tuple[tuple[int, ...], int] = ((), 0)  # (slots to gather, first destination)
    drafted: dict[str, int] = field(default_factory=dict)  # rounds per drafter
    drafted_tokens: dict[str, int] = field(default_factory=dict)  # tokens those rounds committed
    skipped: dict[str, int] = field(default_factory=dict)  # rounds a drafter was not asked (could not pay)
    ahead: deque[Ahead] = field(default_factory=deque)  # rounds sent ahead of the awaited one, oldest first
    pipelined: int = 0  # traversals whose round was sent ahead and turned out valid
    most_in_flight: int = 1  # the most rounds this job had in the ring at once
    discarded: int = 0  # rounds sent ahead on an assumption that failed (their results ignored)
    # (ring epoch, sent at, rows) of discarded rounds the next fresh round may queue behind
    discarded_in_flight: list[tuple[int, float, int]] = field(default_factory=list)
    undrafted_rounds: int = 0  # rounds since the last one that carried a draft
    receipts: JobReceipts | None = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafters read (EAGLE); stages attach them."""
        layers: list[int] = []
        for d in self.drafters:
            layers += [layer for layer in getattr(d, "aux_layers", ()) if layer not in layers]
        return tuple(layers)

    async def next_tokens(self) -> AsyncIterator[list[int]]:
        """One verify round per traversal: the unfed root (last committed token) plus a
        draft; the accepted path and bonus token come back as one block. With no draft
        this is plain decoding, and the first round is the prefill."""
        self.committed = list(self.prompt_ids)
        generator = make_generator(self.params.seed)
        limit = self.engine.max_context_tokens
        while len(self.committed) < limit:
            ahead = self.ahead.popleft() if self.ahead else None
            got = None
            if ahead is not None and self._still_valid(ahead):
                got = await self._collect_ahead(ahead, limit)
            else:  # every round still in flight was built on a context that did not happen
                self._discard_ahead(ahead)
            if got is not None:
                tree, draft_s, queued_behind = ahead.tree, ahead.draft_s, ahead.queued_behind
                rows, traversal_s, fed, tree_aux = got
            else:  # a fresh round queues behind what is left of the discarded ones
                tree, draft_s = self._draft(limit)
                epoch = self.ring_epoch
                behind = adapt.queued_share([(sent_s, n) for e, sent_s, n in self.discarded_in_flight if e == epoch],
                                            time.monotonic(), self.adapt)
                self.discarded_in_flight.clear()
                rows, traversal_s, fed, tree_aux = await self._verify(tree, limit)
                queued_behind = behind if self.ring_epoch == epoch else 0.0
            head = self.engine.head
            if self.params.greedy:  # LM-head rows only along the accepted path
                acc = await trio.to_thread.run_sync(
                    lambda: accept_greedy_lazy(tree, GreedyRows(tree, lambda r: head.logits(rows[r]))))
            else:
                target = probs(await trio.to_thread.run_sync(head.logits, rows), self.params)
                acc = accept_sampling(tree, target, generator)
            root_slot = len(self.committed) - 1
            src = [root_slot + 1 + n for n in acc.nodes]
            # The accepted nodes' K/V move next to the root in the next frame (no extra
            # round trip); a chain's accepted prefix is already in place.
            self.pending_commit = (src, root_slot + 1) if src != list(range(root_slot + 1, root_slot + 1 + len(src))) else ((), 0)
            self.ring_ctx = root_slot + 1 + len(acc.nodes)
            tokens = list(acc.tokens)[: limit - len(self.committed)]
            self._observe(fed, tree, acc, tree_aux, root_slot)
            self.committed += tokens
            if self.ttft_s is None:
                self.ttft_s = time.monotonic() - self.started_s
            self.undrafted_rounds = 0 if tree.num_nodes else self.undrafted_rounds + 1
            if tree.num_nodes:
                family = tree.source.family
                self.drafted[family] = self.drafted.get(family, 0) + 1
                self.drafted_tokens[family] = self.drafted_tokens.get(family, 0) + len(tokens)
                self.adapt = adapt.apply(adapt.RoundVerified(
                    source=tree.source, nodes=tree.num_nodes, tried=acc.tried, accepted=len(acc.nodes),
                    traversal_s=traversal_s, draft_s=draft_s, predicted=self._predicted(tree),
                    parts=tuple(self._outcome(part, acc.tokens) for part in tree.merged_from),
                    queued_behind=queued_behind, chain=tree.is_chain), self.adapt)
            yield tokens

    def _predicted(self, tree: DraftTree) -> float | None:
        """A confident drafter's own estimate of how many of `tree`'s nodes it gets accepted."""
        return sum(adapt.path_probabilities(tree)) if is_confident(self.drafters, tree.source) else None

    def _outcome(self, part: DraftTree, committed: tuple[int, ...]) -> adapt.DraftOutcome:
        """How one drafter's part of a merged draft fared, judged on its own nodes."""
        acc = accept_as_committed(part, committed)
        return adapt.DraftOutcome(part.source, acc.tried, len(acc.nodes), self._predicted(part))

    def _draft(self, limit: int) -> tuple[DraftTree, float]:
        """The next round's draft (coordinator.spec.draft_round; none before the prefill)."""
        if not self.drafters or self.traversals == 0:
            return DraftTree.empty(), 0.0
        tree, draft_s, skipped = draft_round(
            self.drafters, self.committed, self.adapt, room=limit - len(self.committed) - 1,
            max_pipeline_depth=self.engine.config.max_pipeline_depth, undrafted_rounds=self.undrafted_rounds,
            fixed_tree=self.engine.config.eagle_tree)
        for name in skipped:
            self.skipped[name] = self.skipped.get(name, 0) + 1
        return tree, draft_s

    def _observe(self, fed, tree: DraftTree, acc, tree_aux, root_slot: int) -> None:
        """Hand drafters that read the target's features (EAGLE) the aux rows of every
        token this round committed: prefill chunks whole, then the root and accepted path."""
        sinks = [d for d in self.drafters if getattr(d, "aux_layers", ())]
        if not sinks:
            return
        batches = list(fed)
        if tree_aux is not None:
            rows = [0] + [1 + n for n in acc.nodes]
            batches.append((root_slot, [self.committed[root_slot]] + [int(tree.tokens[n]) for n in acc.nodes], tree_aux[rows]))
        for start, ids, aux in batches:
            for d in sinks:
                # After a resume the ring re-prefills tokens a drafter already saw: skip those.
                skip = d.observed_tokens - start
                if skip < len(ids):
                    d.observe(ids[max(skip, 0):], aux[max(skip, 0):])

    async def _verify(self, tree: DraftTree, limit: int) -> tuple[torch.Tensor, float, list, torch.Tensor | None]:
        """Target logits (M+1, V) for the root and each draft node, resuming on a new ring
        (re-prefilling the committed context) when the ring changed or a stage failed."""
        for attempt in range(self.engine.config.max_resumes + 1):
            ring = await self.engine.swarm.wait_ring()
            if ring.epoch != self.ring_epoch:
                if self.traversals:
                    self.resumes += 1
                    self.adapt = adapt.apply(adapt.RingChanged(), self.adapt)  # its timing is new
                    log.info("job %s resumes on ring epoch %d (re-prefill %d tokens)", self.job_id, ring.epoch, len(self.committed))
                self.ring_epoch, self.ring_ctx, self.pending_commit = ring.epoch, 0, ((), 0)
            try:
                return await self._round(ring, tree, limit)
            except (RingLost, JobFailedError, TransportError, trio.TooSlowError) as exc:
                # Whatever happened, the ring may no longer hold this job's K/V: start over
                # from the committed tokens on whichever ring is current next time round.
                log.warning("job %s: round failed on ring epoch %d (%s); resuming", self.job_id, ring.epoch, exc)
                self.ring_epoch, self.ring_ctx, self.pending_commit = -1, 0, ((), 0)
                self._discard_ahead()
                if not isinstance(exc, RingLost):
                    await self.engine.swarm.wait_change(ring.epoch, self.engine.config.resume_wait_s)
        raise JobFailedError(f"job {self.job_id} lost its ring {self.engine.config.max_resumes + 1} times")

    async def _round(self, ring: RingState, tree: DraftTree, limit: int) -> tuple[torch.Tensor, float, list, torch.Tensor | None]:
        """Feed the committed tokens the ring lacks as pipelined chunks (the last chunk ends
        with the root when there is no draft), then the root and the draft as one verify
        frame. The previous round's commit rides in the first frame sent."""
        t0 = time.monotonic()
        start_ctx = self.ring_ctx
        root = len(self.committed) - 1
        config = self.engine.config
        prefix_end = root if tree.num_nodes else root + 1
        src, dst = self.pending_commit
        rounds: list[int] = []
        chunks: dict[int, tuple[int, list[int]]] = {}  # round -> (first position, token ids)
        for start, end in prefill_chunks(self.ring_ctx, prefix_end, config.prefill_chunk_tokens,
                                         config.prefill_edge_chunk_tokens):
            ids = self.committed[start:end]
            rounds.append(await self._send(ring, Forward(
                job_id=self.job_id, epoch=ring.epoch, round=self.round + 1, nonce=self.nonce,
                phase="decode" if len(ids) == 1 and self.traversals else "prefill", ctx_len=start,
                commit_src=tuple(src), commit_dst=dst, want_aux_layers=self.aux_layers,
                positions=torch.arange(start, start + len(ids)), tokens=torch.tensor(ids),
            )))
            chunks[rounds[-1]] = (start, ids)
            src, dst = (), 0
        if tree.num_nodes:
            rounds.append(await self._send(ring, self._verify_frame(ring, root, self.committed[root], tree, src, dst)))
            await self._send_ahead(ring, tree, root, limit, time.monotonic())
        self.pending_commit = ((), 0)
        last = None
        fed, tree_aux = [], None  # aux rows of committed chunks; of the verify frame
        with trio.fail_after(self.engine.config.frame_timeout_s * len(rounds)):
            for expected in rounds:
                last = await self._receive(ring, expected)  # receipts checked (fail closed)
                if self.aux_layers and last.aux is not None:
                    aux = from_wire(last.aux, last.aux_scale, torch.float32)  # (T, k*H)
                    if expected in chunks:
                        fed.append((*chunks[expected], aux))
                    else:
                        tree_aux = aux
        traversal_s = time.monotonic() - t0
        self.engine.swarm.record_traversal(Traversal(
            ring.epoch, prefill=prefix_end - start_ctx > 1, frames=len(rounds),
            tokens=max(0, prefix_end - start_ctx) + (tree.num_nodes + 1 if tree.num_nodes else 0),
            traversal_s=traversal_s, compute_s=tuple(last.compute_s)))
        self.traversals += 1
        return self.engine.hidden(last)[-(tree.num_nodes + 1):], traversal_s, fed, tree_aux

    async def _send_ahead(self, ring: RingState, base: DraftTree, base_root: int, limit: int, base_sent_s: float) -> None:
        """Pipelined rounds: while the chain `base` (root at slot `base_root`) is in the
        ring, keep up to the planner's pipeline depth of rounds in flight, each drafted on
        the assumption that every round before it is accepted whole with the bonus token
        the drafter predicts, and sent at once. A round whose assumption fails is simply
        ignored with all those built on it, and the next frame overwrites their K/V slots
        (lossless either way). Only drafters that need no target features can draft that
        far ahead (n-gram)."""
        depth = self.engine.config.max_pipeline_depth
        if depth < 2 or not base.num_nodes or not base.is_chain:
            return
        drafter = next((d for d in self.drafters if not getattr(d, "aux_layers", ())), None)
        if drafter is None:
            return
        depth = min(depth, adapt.plan(self.adapt, adapt.AdaptConfig(max_pipeline_depth=depth),
                                      source=base.source).pipeline_depth)
        # The context the next round assumes: the awaited chain, then each round in flight
        # after it (its assumed root token and its chain).
        assumed = [*self.committed, *base.tokens.tolist()]
        tail, tail_root = base, base_root
        for a in self.ahead:
            assumed += [a.root_token, *a.tree.tokens.tolist()]
            tail, tail_root = a.tree, a.root
        while 1 + len(self.ahead) < depth:
            t0 = time.perf_counter()
            guess = draft_ahead(drafter, assumed, self.adapt, room=limit - len(assumed) - 2, max_pipeline_depth=depth)
            if guess is None:
                return
            root_token, tree = guess
            root = tail_root + 1 + tail.num_nodes
            in_flight = [(base_sent_s, base.num_nodes + 1)] + [(a.sent_s, a.tree.num_nodes + 1) for a in self.ahead]
            round_id = await self._send(ring, self._verify_frame(ring, root, root_token, tree))
            now = time.monotonic()
            self.ahead.append(Ahead(round_id, ring.epoch, tree, root, root_token, now, time.perf_counter() - t0,
                                    queued_behind=adapt.queued_share(in_flight, now, self.adapt)))
            self.most_in_flight = max(self.most_in_flight, 1 + len(self.ahead))
            assumed += [root_token, *tree.tokens.tolist()]
            tail, tail_root = tree, root

    def _discard_ahead(self, popped: Ahead | None = None) -> None:
        """Forget the rounds in flight (and `popped`, taken off the queue already); the
        next fresh round still queues behind what is left of them."""
        gone = ([popped] if popped is not None else []) + list(self.ahead)
        self.discarded += len(gone)
        self.discarded_in_flight += [(a.epoch, a.sent_s, a.tree.num_nodes + 1) for a in gone]
        self.ahead.clear()

    def _still_valid(self, ahead: "Ahead") -> bool:
        """The in-flight round was built on exactly the context now committed."""
        return (ahead.epoch == self.ring_epoch and ahead.root == len(self.committed) - 1 == self.ring_ctx
                and self.committed[-1] == ahead.root_token and not self.pending_commit[0])

    async def _collect_ahead(self, ahead: "Ahead", limit: int):
        """Receive an in-flight round's result (None if the ring changed meanwhile: the
        caller then drafts afresh). Keeps the pipeline full by topping it up first."""
        ring = self.engine.swarm.ring
        if ring is None or ring.epoch != ahead.epoch:
            self._discard_ahead(ahead)
            return None
        try:
            await self._send_ahead(ring, ahead.tree, ahead.root, limit, ahead.sent_s)
            with trio.fail_after(self.engine.config.frame_timeout_s):
                result = await self._receive(ring, ahead.round)
        except (RingLost, JobFailedError, TransportError, trio.TooSlowError) as exc:
            log.warning("job %s: pipelined round failed (%s); resuming", self.job_id, exc)
            self.ring_epoch, self.ring_ctx, self.pending_commit = -1, 0, ((), 0)
            self._discard_ahead(ahead)
            return None
        self.traversals += 1
        self.pipelined += 1
        aux = from_wire(result.aux, result.aux_scale, torch.float32) if self.aux_layers and result.aux is not None else None
        return self.engine.hidden(result)[-(ahead.tree.num_nodes + 1):], time.monotonic() - ahead.sent_s, [], aux

    def _verify_frame(self, ring: RingState, root: int, root_token: int, tree: DraftTree,
                      commit_src=(), commit_dst: int = 0) -> Forward:
        """The root (at slot `root`) plus the draft: frame parent -1 for the root (it sees
        the context), draft parent + 1 below it; siblings share a position."""
        parents = torch.tensor([-1] + [p + 1 if p >= 0 else 0 for p in tree.parents.tolist()], dtype=torch.int32)  # (1+M,)
        return Forward(
            job_id=self.job_id, epoch=ring.epoch, round=self.round + 1, nonce=self.nonce, phase="verify",
            ctx_len=root, commit_src=tuple(commit_src), commit_dst=commit_dst, tree_parents=parents,
            want_aux_layers=self.aux_layers, positions=torch.cat([torch.tensor([root]), tree.positions(root)]),
            tokens=torch.tensor([root_token, *tree.tokens.tolist()]),
        )

    async def _send(self, ring: RingState, fwd: Forward) -> int:
        self.round += 1
        fwd = dataclasses.replace(fwd, round=self.round)
        body = encode_body(fwd)  # the canonical bytes: hashed for the receipt check, then sent
        if self.receipts is not None:
            self.receipts.sent(fwd, sha256_digest(body))
        await self.engine.send_body(ring, body + encode_trailer(fwd))
        return self.round

    async def _receive(self, ring: RingState, expected_round: int) -> Result:
        """The Result of `expected_round` on `ring`, its receipts checked first when
        receipts are on (ReceiptRejected fails the job closed)."""
        epoch = ring.epoch
        while True:
            msg = await self.inbox.receive()
            if isinstance(msg, RingLost):
                raise msg
            if isinstance(msg, JobError):
                if msg.epoch == epoch:
                    raise JobFailedError(f"stage {msg.stage} failed: {msg.code}: {msg.message}")
                continue
            if msg.result.epoch == epoch and msg.result.round == expected_round:
                if self.receipts is not None:
                    self.receipts.check(ring, msg.result, msg.digest)
                return msg.result
            # a stale result from a discarded round or an old epoch: ignore it

    def stats(self) -> dict[str, Any]:
        generated = max(len(self.committed) - len(self.prompt_ids), 0)
        # The first traversal (prefill) commits the first token, so tokens per traversal is
        # generated / traversals; plain decoding gives exactly 1.0.
        return {"traversals": self.traversals, "tokens_per_traversal": generated / self.traversals if self.traversals else 0.0,
                "ring_epoch": self.ring_epoch, "ttft_s": self.ttft_s, "resumes": self.resumes,
                "drafter": self.engine.config.draft, "draft_rounds": dict(self.drafted),
                "draft_round_tokens": dict(self.drafted_tokens), "drafter_skipped_rounds": dict(self.skipped),
                "pipelined_rounds": self.pipelined, "most_rounds_in_flight": self.most_in_flight,
                "pipelined_rounds_discarded": self.discarded, "planner": self._planner_stats(),
                "job_id": self.job_id}

    def _planner_stats(self) -> dict[str, float | None]:
        """What the planner measured of the ring (ms): a traversal's fixed part and cost
        per row, and the queue one round in flight makes for another (None: unmeasured)."""
        fixed_s, per_row_s = adapt.traversal_line(self.adapt) if self.adapt.traversal else (None, None)
        queue_s = self.adapt.queue_s
        return {name: None if v is None else round(v * 1e3, 2) for name, v in (
            ("traversal_fixed_ms", fixed_s), ("traversal_per_row_ms", per_row_s), ("queue_ms", queue_s))}

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.close_job(self.job_id)
        if self.adapt.rounds:
            self.engine.learned_adapt = (self.ring_epoch, self.adapt)
        if self.receipts is not None:
            self.receipts.finish(self.committed[len(self.prompt_ids):])
        ring = self.engine.swarm.ring
        if ring is not None and ring.epoch == self.ring_epoch:
            try:
                await self.engine.send(ring, EndJob(job_id=self.job_id, epoch=ring.epoch))
            except TransportError:
                pass
