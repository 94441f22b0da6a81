"""One request on the ring: verify rounds, their drafts, pipelined rounds, and resume.

A RingJob brings the ring's K/V up to its committed tokens and runs one verify round per
traversal (the root plus a draft; the accepted path and bonus token come back as one
block), keeps the rounds coordinator.jobs.pipeline decides on in flight when chains are
likely to be accepted whole, hands the drafters what they observe, and starts over on
whichever ring is current when its ring changes. Its counters are folded from round
events (coordinator.jobs.job_stats). It receives through its own inbox and asks the engine
only through its port (coordinator.jobs.port), not knowing the engine, streams or swarm.
What a round's result passes before its rows become tokens is coordinator.jobs.release_gate's."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from receipts import sha256_digest
from coordinator.errors import EmptyPromptError, JobFailedError, KVRefused, RingLost, RingWaitTimeout
from coordinator.spec import adapt
from coordinator.spec.accept import Acceptance, accept_as_committed
from coordinator.spec.grammar import GrammarState, start_grammar
from coordinator.spec.target import TokenLogprob, accept_round
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.draft_round import draft_round, is_confident
from coordinator.spec.drafting import Drafter
from coordinator.jobs import job_stats
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.frames import (Verified, aux_rows, chunk_frame, commit_move, hidden_rows, observe_round,
                                     verify_frame)
from coordinator.jobs.head_batch import HeadBatcher, accept_batched, take_next_burst
from coordinator.jobs.job_stats import JobStats
from coordinator.jobs.pipeline import Ahead, ahead_drafter, next_ahead, pipeline_depth, queued_rows, still_valid
from coordinator.jobs.port import JobPort
from coordinator.jobs.prefill import prefill_chunks
from coordinator.jobs.release_gate import ReleaseGate, receive_result
from coordinator.spec.sampling import SamplingParams, job_seed
from coordinator.swarm.swarm import RingState
from coordinator.swarm.topology import Traversal
from shard.ring_observer import NO_OBSERVER, RingObserver
from shard.transport import TransportError
from shard.wire.codec import encode, encode_body, encode_trailer
from shard.wire.messages import EndJob, Forward, Result

log = logging.getLogger("shard.coordinator")

# What ends a round on this ring: the job then resumes from its committed tokens.
ROUND_FAILURES = (RingLost, JobFailedError, TransportError, trio.TooSlowError)
MAX_KV_WAITS = 16  # rounds refused for K/V a job waits out before they count as failures


@dataclass
class RingJob:
    port: JobPort
    job_id: str
    prompt_ids: list[int]
    params: SamplingParams
    inbox: trio.MemoryReceiveChannel
    config: EngineConfig
    head: HeadBatcher  # the final norm and LM head (hidden rows -> logits), shared by every job
    max_context_tokens: int
    nonce: bytes = field(default_factory=lambda: os.urandom(16))
    committed: list[int] = field(default_factory=list)
    ring_ctx: int = 0  # tokens of `committed` whose K/V the ring holds (for ring_epoch)
    ring_epoch: int = -1
    round: int = 0
    started_s: float = field(default_factory=time.monotonic)
    closed: bool = False
    drafters: list[Drafter] = field(default_factory=list)
    adapt: adapt.AdaptState = field(default_factory=adapt.AdaptState)
    pending_commit: tuple[tuple[int, ...], int] = ((), 0)  # (slots to gather, first destination)
    counts: JobStats = field(default_factory=JobStats)
    ahead: deque[Ahead] = field(default_factory=deque)  # rounds sent ahead of the awaited one, oldest first
    discarded_in_flight: list[Ahead] = field(default_factory=list)  # discarded rounds a fresh one may queue behind
    receipts: ReleaseGate | None = None  # receipts, probation: what a round passes before release
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per committed token, when asked
    observer: RingObserver = NO_OBSERVER  # what a benchmark watches of its rounds
    prefix: tuple[str, int] | None = None  # (source job, tokens) its K/V started from (coordinator.jobs.prefix_cache)
    fork_next: tuple[str, int] | None = None  # that prefix, until the frame naming it is sent
    clean: bool = True  # no round failed: its K/V may serve later prompts

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafters read (EAGLE); stages attach them."""
        layers: list[int] = []
        for d in self.drafters:
            layers += [layer for layer in getattr(d, "aux_layers", ()) if layer not in layers]
        return tuple(layers)

    def _fold(self, event: job_stats.Event) -> None:
        self.counts = job_stats.apply(event, self.counts)

    async def next_tokens(self) -> AsyncIterator[list[int]]:
        """One verify round per traversal: the unfed root (last committed token) plus a
        draft; the accepted path and bonus token come back as one block. With no draft
        this is plain decoding, and the first round is the prefill."""
        if not self.prompt_ids:  # no root to verify after: no round could be sent
            raise EmptyPromptError()
        self.committed = list(self.prompt_ids)
        seed, limit, grammar = job_seed(self.params.seed), self.max_context_tokens, start_grammar(self.params.constraint)
        while len(self.committed) < limit:
            got = await self._next_round(limit)
            acc = await self._accept(got, seed, grammar)
            root_slot = len(self.committed) - 1
            tokens = self._commit(acc, limit)
            observe_round(self.drafters, got, acc, self.committed, root_slot)
            self._learn(got, acc, tokens)
            yield tokens

    async def _next_round(self, limit: int) -> Verified:
        """The oldest round sent ahead if it is still valid and comes back, else a fresh
        round, drafted now, queued behind what is left of the discarded ones."""
        ahead = self.ahead.popleft() if self.ahead else None
        if ahead is not None and still_valid(ahead, epoch=self.ring_epoch, committed=self.committed,
                                             ring_ctx=self.ring_ctx, pending_src=self.pending_commit[0]):
            got = await self._collect_ahead(ahead, limit)
            if got is not None:
                return got
        else:  # every round still in flight was built on a context that did not happen
            self._discard_ahead(ahead)
        tree, draft_s = self._draft(limit)
        epoch = self.ring_epoch
        behind = adapt.queued_share(queued_rows(self.discarded_in_flight, epoch), time.monotonic(), self.adapt)
        self.discarded_in_flight.clear()
        rows, traversal_s, fed, tree_aux = await self._verify(tree, limit)
        # On a new ring the discarded rounds are gone: nothing was queued ahead of this one.
        queued_behind = behind if self.ring_epoch == epoch else 0.0
        return Verified(tree, rows, traversal_s, draft_s, queued_behind, fed, tree_aux, pipelined=False)

    async def _accept(self, got: Verified, seed: int, grammar: GrammarState | None) -> Acceptance:
        """The target's token per row walked (coordinator.spec.target), from the head all jobs share (head_batch)."""
        acc, logprobs = await accept_batched(self.head, got.rows, lambda logits_of: accept_round(got.tree, logits_of,
            self.params, seed, len(self.committed) - 1, self.committed[len(self.prompt_ids):], grammar),
            cheap=self.params.greedy and grammar is None and self.params.logprobs is None)
        self.token_logprobs += logprobs[: self.max_context_tokens - len(self.committed)]  # as _commit clips
        return acc

    def _commit(self, acc: Acceptance, limit: int) -> list[int]:
        """Commit the accepted path and bonus token (clipped to the context); the ring then
        holds the root and the accepted nodes, whose K/V the next frame moves into place."""
        root_slot = len(self.committed) - 1
        self.pending_commit = commit_move(root_slot, acc.nodes)
        self.ring_ctx = root_slot + 1 + len(acc.nodes)
        tokens = list(acc.tokens)[: limit - len(self.committed)]
        self.committed += tokens
        return tokens

    def _learn(self, got: Verified, acc: Acceptance, tokens: list[int]) -> None:
        """Fold a committed round into the job's counters and the planner's state."""
        tree = got.tree
        self._fold(job_stats.RoundCommitted(
            family=tree.source.family if tree.num_nodes else None, tokens=len(tokens),
            pipelined=got.pipelined, since_start_s=time.monotonic() - self.started_s, traversal_s=got.traversal_s))
        if tree.num_nodes:
            self.adapt = adapt.apply(adapt.RoundVerified(
                source=tree.source, nodes=tree.num_nodes, tried=acc.tried, accepted=len(acc.nodes),
                traversal_s=got.traversal_s, draft_s=got.draft_s, predicted=self._predicted(tree),
                parts=tuple(self._outcome(part, acc.tokens) for part in tree.merged_from),
                queued_behind=got.queued_behind, chain=tree.is_chain), self.adapt)

    def _predicted(self, tree: DraftTree) -> float | None:
        """A confident drafter's own estimate of how many of `tree`'s nodes it gets accepted."""
        return sum(adapt.path_probabilities(tree)) if is_confident(self.drafters, tree.source) else None

    def _outcome(self, part: DraftTree, committed: tuple[int, ...]) -> adapt.DraftOutcome:
        """How one drafter's part of a merged draft fared, judged on its own nodes."""
        acc = accept_as_committed(part, committed)
        return adapt.DraftOutcome(part.source, acc.tried, len(acc.nodes), self._predicted(part))

    def _draft(self, limit: int) -> tuple[DraftTree, float]:
        """The next round's draft (coordinator.spec.draft_round; none before the prefill)."""
        if not self.drafters or self.counts.traversals == 0:
            return DraftTree.empty(), 0.0
        tree, draft_s, skipped = draft_round(
            self.drafters, self.committed, self.adapt, room=limit - len(self.committed) - 1,
            max_pipeline_depth=self.config.max_pipeline_depth, undrafted_rounds=self.counts.undrafted_rounds,
            fixed_tree=self.config.eagle_tree)
        if skipped:
            self._fold(job_stats.DrafterSkipped(skipped))
        return tree, draft_s

    async def _verify(self, tree: DraftTree, limit: int) -> tuple[torch.Tensor, float, list, torch.Tensor | None]:
        """The tail's hidden rows (M+1, H) for the root and each draft node (the output head
        makes them logits), with the traversal time and the aux rows the round brought back;
        resumes on a new ring (re-prefilling the committed context) when the ring changed or
        a stage failed."""
        failures = kv_waits = 0
        while failures <= self.config.max_resumes:
            ring = await self._wait_ring()
            if ring.epoch != self.ring_epoch:
                if self.counts.traversals:
                    self._fold(job_stats.Resumed())
                    self.adapt = adapt.apply(adapt.RingChanged(), self.adapt)  # its timing is new
                    log.info("job %s resumes on ring epoch %d (re-prefill %d tokens)", self.job_id, ring.epoch, len(self.committed))
                self.ring_epoch, self.ring_ctx, self.pending_commit = ring.epoch, 0, ((), 0)
            try:
                return await self._round(ring, tree, limit)
            except ROUND_FAILURES as exc:
                # Whatever happened, the ring may no longer hold this job's K/V: start over
                # from the committed tokens on whichever ring is current next time round.
                log.warning("job %s: round failed on ring epoch %d (%s); resuming", self.job_id, ring.epoch, exc)
                forked, self.clean = self.prefix is not None and not self.counts.traversals and self.clean, False
                if forked:
                    self.port.fork_failed(self.prefix[0])
                if isinstance(exc, trio.TooSlowError):  # a stage holds it: the port blames one, the ring re-forms
                    self.port.round_missed(ring, self.round)
                self.ring_epoch, self.ring_ctx, self.pending_commit = -1, 0, ((), 0)
                self._discard_ahead()
                if isinstance(exc, KVRefused) and kv_waits < MAX_KV_WAITS:  # no failure: wait for room, resume
                    kv_waits += 1
                    await self.port.wait_room(self.config.kv_wait_s)
                    continue
                failures += 1
                if not isinstance(exc, RingLost) and not forked:  # a failed fork re-prefills at once
                    await self.port.wait_change(ring.epoch, self.config.resume_wait_s)
        raise JobFailedError(f"job {self.job_id} lost its ring {self.config.max_resumes + 1} times")

    async def _wait_ring(self) -> RingState:
        """The current ring, waiting at most `config.ring_wait_s` for one to (re-)form.
        Error handling: RingWaitTimeout (a NotReadyError: 503) when none forms in time."""
        with trio.move_on_after(self.config.ring_wait_s):
            return await self.port.wait_ring()
        raise RingWaitTimeout(self.config.ring_wait_s)

    async def _round(self, ring: RingState, tree: DraftTree, limit: int) -> tuple[torch.Tensor, float, list, torch.Tensor | None]:
        """Feed the committed tokens the ring lacks as pipelined chunks (the last chunk ends
        with the root when there is no draft), then the root and the draft as one verify
        frame. The previous round's commit rides in the first frame sent."""
        self._fork(ring)
        t0, start_ctx, root, config = time.monotonic(), self.ring_ctx, len(self.committed) - 1, self.config
        prefix_end = root if tree.num_nodes else root + 1
        commit = self.pending_commit  # rides in the first frame only
        rounds: list[int] = []
        chunks: dict[int, tuple[int, list[int]]] = {}  # round -> (first position, token ids)
        for start, end in prefill_chunks(self.ring_ctx, prefix_end, config.prefill_chunk_tokens,
                                         config.prefill_edge_chunk_tokens):
            ids = self.committed[start:end]
            rounds.append(await self._send(ring, chunk_frame(
                self.job_id, ring.epoch, self.nonce, start, ids, decode=len(ids) == 1 and self.counts.traversals > 0,
                commit=commit, aux_layers=self.aux_layers)))
            chunks[rounds[-1]] = (start, ids)
            commit = ((), 0)
        if tree.num_nodes:
            rounds.append(await self._send(ring, verify_frame(
                self.job_id, ring.epoch, self.nonce, root, self.committed[root], tree, commit=commit,
                aux_layers=self.aux_layers)))
            await self._send_ahead(ring, tree, root, limit, time.monotonic())
        self.pending_commit = ((), 0)
        last, fed, tree_aux = None, [], None  # the last result; aux rows of committed chunks, of the verify frame
        shape = Traversal(ring.epoch, prefill=prefix_end - start_ctx > 1, frames=len(rounds), traversal_s=0.0, compute_s=(),
                          tokens=max(0, prefix_end - start_ctx) + (tree.num_nodes + 1 if tree.num_nodes else 0))
        with self.port.round_timer(ring, shape):  # coordinator.jobs.deadline, liveness
            for expected in rounds:
                last = await self._receive(ring, expected)  # receipts checked (fail closed)
                if self.aux_layers and last.aux is not None:
                    aux = aux_rows(last)  # (T, k*H)
                    if expected in chunks:
                        fed.append((*chunks[expected], aux))
                    else:
                        tree_aux = aux
        traversal_s = time.monotonic() - t0
        await self._release(ring, last)  # outside the deadline: a verifier's time is not the ring's
        self.port.record_traversal(dataclasses.replace(shape, traversal_s=traversal_s, compute_s=tuple(last.compute_s)))
        return hidden_rows(last, tree.num_nodes + 1), traversal_s, fed, tree_aux

    async def _send_ahead(self, ring: RingState, base: DraftTree, base_root: int, limit: int, base_sent_s: float) -> None:
        """While the chain `base` (root at slot `base_root`, sent at `base_sent_s`) is in
        the ring, send the rounds coordinator.jobs.pipeline plans after it, one at a time
        (each is sent before the next is drafted). A round whose assumption fails is
        ignored with all those built on it (lossless either way)."""
        drafter = ahead_drafter(self.drafters)
        if drafter is None:
            return
        depth = pipeline_depth(base, self.adapt, self.config.max_pipeline_depth)
        while True:
            t0 = time.perf_counter()
            planned = next_ahead(drafter, self.committed, base, base_root, self.ahead, self.adapt,
                                 depth=depth, limit=limit)
            if planned is None:
                return
            in_flight = [(base_sent_s, base.num_nodes + 1), *queued_rows(self.ahead)]
            round_id = await self._send(ring, verify_frame(self.job_id, ring.epoch, self.nonce, planned.root,
                                                           planned.root_token, planned.tree, aux_layers=self.aux_layers))
            now = time.monotonic()
            # Its drafting time includes the send: what sending it ahead cost the coordinator.
            self.ahead.append(Ahead(round_id, ring.epoch, planned.tree, planned.root, planned.root_token, now,
                                    time.perf_counter() - t0, queued_behind=adapt.queued_share(in_flight, now, self.adapt)))
            self._fold(job_stats.RoundSentAhead(in_flight=1 + len(self.ahead)))

    def _discard_ahead(self, popped: Ahead | None = None) -> None:
        """Forget the rounds in flight (and `popped`, taken off the queue already); the
        next fresh round still queues behind what is left of them."""
        gone = ([popped] if popped is not None else []) + list(self.ahead)
        if gone:
            self._fold(job_stats.RoundsDiscarded(len(gone)))
        self.discarded_in_flight += gone
        self.ahead.clear()

    async def _collect_ahead(self, ahead: Ahead, limit: int) -> Verified | None:
        """Receive an in-flight round's result (None if the ring changed meanwhile: the
        caller then drafts afresh). Keeps the pipeline full by topping it up first."""
        ring = self.port.ring
        if ring is None or ring.epoch != ahead.epoch:
            self._discard_ahead(ahead)
            return None
        try:
            await self._send_ahead(ring, ahead.tree, ahead.root, limit, ahead.sent_s)
            with self.port.round_timer(ring, Traversal(
                    ring.epoch, prefill=False, frames=1, tokens=ahead.tree.num_nodes + 1, traversal_s=0.0, compute_s=())):
                result = await self._receive(ring, ahead.round)
            await self._release(ring, result)
        except ROUND_FAILURES as exc:
            log.warning("job %s: pipelined round failed (%s); resuming", self.job_id, exc)
            self.clean = False
            if isinstance(exc, trio.TooSlowError):  # as in _verify
                self.port.round_missed(ring, ahead.round)
            self.ring_epoch, self.ring_ctx, self.pending_commit = -1, 0, ((), 0)
            self._discard_ahead(ahead)
            return None
        aux = aux_rows(result) if self.aux_layers else None
        return Verified(ahead.tree, hidden_rows(result, ahead.tree.num_nodes + 1), time.monotonic() - ahead.sent_s,
                        ahead.draft_s, ahead.queued_behind, [], aux, pipelined=True)

    async def _send(self, ring: RingState, fwd: Forward) -> int:
        """Number `fwd` as this job's next round, note its canonical bytes for the receipt
        check, and send it; returns its round."""
        self.round += 1
        fwd = dataclasses.replace(fwd, round=self.round, burst=take_next_burst())  # the head product's (head_batch)
        if self.fork_next is not None:
            (source, n), self.fork_next = self.fork_next, None
            fwd = dataclasses.replace(fwd, prefix_job=source, prefix_len=n)
        self.observer.round_sent(fwd)
        body = encode_body(fwd)  # the canonical bytes: hashed for the receipt check, then sent
        if self.receipts is not None:
            self.receipts.sent(fwd, sha256_digest(body))
        await self.port.send_body(ring, body + encode_trailer(fwd), fwd)
        return self.round

    async def _receive(self, ring: RingState, expected_round: int) -> Result:
        """The Result of `expected_round` on `ring`, its receipts checked first (coordinator.jobs.release_gate).
        A job that waits for a Result sends nothing more for its head product's burst (coordinator.jobs.burst_gate)."""
        if burst := take_next_burst():
            self.port.leave_burst(burst)
        return await receive_result(self.inbox, self.port, ring, expected_round, self.receipts,
                                    self.head.skipped if self.head is not None else None)

    async def _release(self, ring: RingState, result: Result) -> None:
        """Before `result`'s rows become tokens: the probation checks that wait on verifier
        nodes (JobFailedError on a catch: the round, and those sent ahead on it, go)."""
        if self.receipts is not None:
            await self.receipts.release(ring, result)

    def _fork(self, ring: RingState) -> None:
        """On its first round, start from a kept source's K/V where one shares the prompt's
        first tokens (and from its drafters' state, for those reading the target's features):
        the round then feeds only the rest. Never after a failed round."""
        if self.counts.traversals or self.prefix is not None or not self.clean:
            return
        hit = self.port.prefix_for(ring, self.committed, self.drafters)
        if hit is not None:
            (self.prefix, self.drafters), self.fork_next = hit, hit[0]
            self.ring_ctx = self.prefix[1]

    def stats(self) -> dict[str, Any]:
        return job_stats.figures(self.counts, generated=max(len(self.committed) - len(self.prompt_ids), 0),
                                 ring_epoch=self.ring_epoch, drafter=self.config.draft, planner=self.adapt,
                                 job_id=self.job_id)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.port.close()
        if self.adapt.rounds:
            self.port.hand_back(self.ring_epoch, self.adapt)
        ring = self.port.ring
        # Offered as a prefix source before its receipts go to the audits (which must find it pinned):
        # K/V it computed itself on one ring epoch that still stands, through rounds that all held.
        # With a commit pending, slots past its destination are not in place yet.
        kept = (ring is not None and ring.epoch == self.ring_epoch and self.clean and self.prefix is None
                and self.port.keep_source(ring, self.job_id, self.committed[:self.pending_commit[1] or self.ring_ctx],
                                          self.drafters))
        if self.receipts is not None:
            await self.receipts.finish(self.committed[len(self.prompt_ids):])
        if ring is not None and ring.epoch == self.ring_epoch:  # a source's end keeps its K/V there
            try:
                await self.port.send_body(ring, encode(EndJob(job_id=self.job_id, epoch=ring.epoch, keep=int(kept))))
            except TransportError:
                pass
