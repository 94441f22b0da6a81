"""Choosing the draft's shape: chain length K or tree size M, depth, and pipelining depth.

Exo style: `apply(event, state) -> state` folds measurements (acceptance, draft time,
traversal time) into EWMAs, and `plan(state) -> DraftShape` picks the shape that
maximises expected committed tokens per second. `route` scores competing drafts (n-gram,
EAGLE chain, EAGLE tree) the same way. Everything is a pure function of its arguments.

Acceptance model: a draft node is accepted, given its parent was, with probability
a * (1 - a)^rank, where rank is its index among its siblings (siblings are tried in
order and each succeeds with probability a). A chain of K then commits
1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a) tokens per traversal on average, and `a`
is estimated as accepted / tried nodes, the maximum-likelihood estimate under that model.

Pipelining model: with P rounds in flight, round r+1 leaves before round r returns,
assuming r's chain and a guessed bonus are all accepted (probability s = w * a, where w,
the chance a chain of K is accepted whole, is a^K times a calibration measured on every
chain round: the EWMA of whole acceptances over the EWMA of a^K at the time; an n-gram
copy is accepted whole far more often than independent nodes would be, a drifting one
far less); otherwise it is discarded with every round after it. A run of rounds ends
at the first one that is not fully accepted, which gives tokens per second
E / (T (1 - s) + s I + (1 - s) (P - 1) Q), where E is the expected tokens per round, T
the round's latency, Q how long one round in flight ahead of another delays it (the
ring's busy time per round), I = max(T / P, draft + Q) the launch interval, and the last
term the P - 1 discarded rounds the next fresh round waits behind. P = 1 gives E / T.
Q is measured: a round sent while k others were in flight returns k Q later than the
traversal line predicts (`RoundVerified.queued_behind`), where each round ahead counts
by the share of its predicted traversal still to run (`queued_share`): one sent just
before counts 1, one about to return nearly 0. On a latency-bound WAN ring Q is
about the busiest stage's compute, so deep pipelines pay; where the stages share a CPU Q
is nearly the whole round and they do not. Until measured, Q is the round's marginal row
time (optimistic, so pipelining gets tried and measured). Only chains of one node or
more are pipelined (the engine sends ahead below a chain), and only when the caller's
config allows it: a drafter that needs the target's features of the round before
(EAGLE) cannot draft ahead, so the engine plans its rounds with max_pipeline_depth 1.

Confidence: a drafter whose log-probs estimate the target's choices (EAGLE) reports, per
round, the sum of its nodes' path probabilities (`RoundVerified.predicted`); `apply`
folds it with the accepted nodes into a per-family calibration, which
`coordinator.spec.confidence` sizes such drafts by.

Choosing among competing drafts (n-gram, EAGLE, their merge) is `coordinator.spec.routing`;
it scores them with this module's models.

This module does not know about tokens, logits, the ring's members or the network.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget
from coordinator.spec.source import ALL_SOURCES, DraftSource


class DraftKind(enum.Enum):
    CHAIN = "chain"
    TREE = "tree"


@dataclass(frozen=True)
class DraftShape:
    """What the next round drafts: `nodes` in total (K for a chain), at most `depth`
    deep, with `pipeline_depth` rounds in flight."""

    kind: DraftKind
    nodes: int
    depth: int
    pipeline_depth: int

    def budget(self) -> DraftBudget:
        return DraftBudget(self.nodes, self.depth)


@dataclass(frozen=True)
class AdaptConfig:
    """Priors before measurements, the shapes considered, and the EWMA weight."""

    ewma_alpha: float = 0.2  # weight of the newest round
    prior_acceptance: float = 0.5
    prior_traversal_s: float = 0.2  # fixed part of one traversal (latency)
    prior_per_node_s: float = 0.002  # marginal ring time of one more draft row
    # A long quote: 16 nodes at 0.95 acceptance commit 11.6 tokens a round (8 nodes: 7.3),
    # and on the CPU ring 8 more rows cost about 4 ms each (bench_stage, 8 -> 16 rows).
    max_chain: int = 16
    tree_nodes: tuple[int, ...] = (8, 16, 32, 64)
    tree_depths: tuple[int, ...] = (3, 4, 6, 8)
    kinds: tuple[DraftKind, ...] = (DraftKind.CHAIN, DraftKind.TREE)
    max_pipeline_depth: int = 4
    # A deeper pipeline burns ring compute on rounds that may be discarded (other jobs
    # share the ring), so it must buy at least this relative speed-up.
    min_pipeline_gain: float = 0.05
    max_acceptance: float = 0.99  # keeps the model from promising unbounded chains
    # Confidence planning: how big a tree a confident drafter drafts before pruning,
    # the calibration before any round, and the range it is held to.
    confident_nodes: int = 48
    confident_depth: int = 8
    prior_calibration: float = 0.8
    calibration_range: tuple[float, float] = (0.2, 1.5)

    def __post_init__(self) -> None:
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError(f"AdaptConfig.ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if not self.kinds or self.max_chain < 0 or self.max_pipeline_depth < 1:
            raise ValueError("AdaptConfig needs kinds, max_chain >= 0 and max_pipeline_depth >= 1")


@dataclass(frozen=True)
class AcceptanceStats:
    """EWMAs of accepted and tried draft nodes per round."""

    accepted: float
    tried: float

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0


@dataclass(frozen=True)
class TraversalFit:
    """EWMA moments of (draft rows n, traversal seconds t) for a line t = c + b n."""

    n: float
    t: float
    nn: float
    nt: float


@dataclass(frozen=True)
class AdaptState:
    # per source at every width (`DraftSource.fallbacks`): its own, its family's, all drafters'
    acceptance: Mapping[DraftSource, AcceptanceStats] = field(default_factory=dict)
    traversal: TraversalFit | None = None
    draft_s_per_node: float = 0.0
    rounds: int = 0
    # per drafter family (`DraftSource.family_key`): EWMAs of accepted nodes and of the
    # draft's predicted acceptances
    confidence: Mapping[DraftSource, AcceptanceStats] = field(default_factory=dict)
    # EWMA of how long one round in flight ahead delays another (Q in the module
    # docstring); None until a round has been sent behind another
    queue_s: float | None = None
    # per drafter family (`DraftSource.family_key`), over its chain rounds: EWMAs of whole
    # acceptances (1 or 0) and of what the rank model predicted for them (a^K)
    whole: Mapping[DraftSource, AcceptanceStats] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftOutcome:
    """How one drafter's part of a merged draft fared, judged on its own nodes."""

    source: DraftSource
    tried: int
    accepted: int
    predicted: float | None = None


@dataclass(frozen=True)
class RoundVerified:
    """One round came back and was verified."""

    source: DraftSource  # DraftTree.source, e.g. ngram:3 or eagle:tree
    nodes: int  # draft nodes sent (the ring computed nodes + 1 rows)
    tried: int  # Acceptance.tried
    accepted: int  # len(Acceptance.nodes)
    traversal_s: float  # send to return, ring only
    draft_s: float  # coordinator time spent drafting this round
    predicted: float | None = None  # sum of the sent nodes' path probabilities (confident drafters)
    # A merged draft (hybrid): each drafter's own outcome, which the acceptance statistics
    # learn from instead of the round's source, tried, accepted and predicted.
    parts: tuple[DraftOutcome, ...] = ()
    # Rounds that were in flight ahead of this one when it was sent (pipelined rounds,
    # and discarded ones still in the ring), each by the share of it still to run
    # (`queued_share`): its traversal then measures the queue, not the line, and does
    # not move the traversal fit. Below MIN_QUEUED_SHARE the queue is too small a part
    # of the round to measure (the excess would be divided by almost nothing).
    queued_behind: float = 0.0
    chain: bool = False  # the draft was one chain (`tree.is_chain`): its whole acceptance is learnt


@dataclass(frozen=True)
class RingChanged:
    """The ring was re-selected: its timing is unknown again; acceptance still holds."""


Event = RoundVerified | RingChanged


MIN_QUEUED_SHARE = 0.5


def queued_share(in_flight: Iterable[tuple[float, int]], now_s: float, state: AdaptState,
                 config: AdaptConfig = AdaptConfig()) -> float:
    """How many rounds' worth of queue a round sent at `now_s` waits behind: each round
    in flight, (sent at, rows), counts the share of its predicted traversal (the line)
    not yet elapsed."""
    fixed_s, per_row_s = traversal_line(state, config)
    share = 0.0
    for sent_s, rows in in_flight:
        predicted_s = fixed_s + per_row_s * rows
        share += max(0.0, 1.0 - (now_s - sent_s) / predicted_s) if predicted_s > 0 else 0.0
    return share


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def _fold(old: AcceptanceStats | None, accepted: float, tried: float, alpha: float) -> AcceptanceStats:
    """A pair of EWMAs with one more observation; the first observation starts them."""
    if old is None:
        return AcceptanceStats(accepted, tried)
    return AcceptanceStats(_ewma(old.accepted, accepted, alpha), _ewma(old.tried, tried, alpha))


def apply(event: Event, state: AdaptState, config: AdaptConfig = AdaptConfig()) -> AdaptState:
    """Fold one event into the state; returns a new state."""
    if isinstance(event, RingChanged):
        return replace(state, traversal=None, queue_s=None)
    alpha = config.ewma_alpha
    whole = dict(state.whole)
    if event.chain and event.nodes:
        family = event.source.family_key
        predicted = acceptance_rate(state, event.source, config) ** event.nodes
        hit = float(event.accepted == event.nodes)
        whole[family] = _fold(whole.get(family), hit, predicted, alpha)
    acceptance = dict(state.acceptance)
    confidence = dict(state.confidence)
    outcomes = event.parts or (DraftOutcome(event.source, event.tried, event.accepted, event.predicted),)
    for out in outcomes:
        for key in out.source.fallbacks:
            prior = AcceptanceStats(config.prior_acceptance, 1.0)
            acceptance[key] = _fold(acceptance.get(key, prior), out.accepted, out.tried, alpha)
        if out.predicted is not None:
            family = out.source.family_key
            confidence[family] = _fold(confidence.get(family), out.accepted, out.predicted, alpha)
    n, t = float(event.nodes + 1), event.traversal_s
    fit, queue = state.traversal, state.queue_s
    if event.queued_behind:
        if fit is not None and event.queued_behind >= MIN_QUEUED_SHARE:  # the queue is what the line does not explain
            fixed_s, per_row_s = traversal_line(state, config)
            delay = max(0.0, t - fixed_s - per_row_s * n) / event.queued_behind
            queue = delay if queue is None else _ewma(queue, delay, alpha)
    elif fit is None:  # first measurement on this ring: start the moments there, not at 0
        fit = TraversalFit(n, t, n * n, n * t)
    else:
        fit = TraversalFit(
            _ewma(fit.n, n, alpha), _ewma(fit.t, t, alpha), _ewma(fit.nn, n * n, alpha), _ewma(fit.nt, n * t, alpha)
        )
    per_node = event.draft_s / max(event.nodes, 1)
    draft = per_node if state.rounds == 0 else _ewma(state.draft_s_per_node, per_node, alpha)
    return AdaptState(acceptance, fit, draft, state.rounds + 1, confidence, queue, whole)


def chain_survives(state: AdaptState, source: DraftSource, a: float, nodes: int) -> float:
    """s in the module docstring: the chance that a chain of `nodes` from `source`, at
    per-node acceptance `a`, is accepted whole with the bonus the drafter guesses: a^K
    calibrated by the family's measured whole acceptances (1 until measured), times a."""
    stats = state.whole.get(source.family_key)
    c = stats.accepted / stats.tried if stats is not None and stats.tried > 0 else 1.0
    return min(1.0, c * a**nodes) * a


def path_probabilities(tree: DraftTree) -> list[float]:
    """Each node's draft probability of its whole path (needs `logprobs`)."""
    return tree.cumulative_logprobs().exp().tolist()


def acceptance_rate(state: AdaptState, source: DraftSource = ALL_SOURCES,
                    config: AdaptConfig = AdaptConfig()) -> float:
    """Per-node acceptance for `source`, falling back to its family ("ngram"), then to
    all drafters, then to the prior."""
    for key in source.fallbacks:
        if key in state.acceptance:
            return min(state.acceptance[key].rate, config.max_acceptance)
    return min(config.prior_acceptance, config.max_acceptance)


def traversal_line(state: AdaptState, config: AdaptConfig = AdaptConfig()) -> tuple[float, float]:
    """(fixed_s, per_row_s) of traversal time = fixed_s + per_row_s * rows."""
    fit = state.traversal
    if fit is None:
        return config.prior_traversal_s, config.prior_per_node_s
    var = fit.nn - fit.n * fit.n
    # Below one row of spread the slope is noise; keep the prior and fit the intercept.
    slope = max(0.0, (fit.nt - fit.n * fit.t) / var) if var >= 1.0 else config.prior_per_node_s
    return max(0.0, fit.t - slope * fit.n), slope


def expected_tokens_chain(a: float, k: int) -> float:
    """1 + a + ... + a^k: accepted drafts plus the bonus, per traversal."""
    return sum(a**d for d in range(k + 1))


def rank_reach(tree: DraftTree, a: float) -> list[float]:
    """Each node's probability of being accepted under the rank model (module docstring)."""
    reach: list[float] = []
    for p, rank in zip(tree.parents.tolist(), tree.sibling_ranks()):
        here = a * (1 - a) ** rank
        reach.append(here if p < 0 else reach[p] * here)
    return reach


def expected_tokens(tree: DraftTree, a: float) -> float:
    """1 + sum over nodes of P(node accepted) under the rank model (module docstring)."""
    return 1.0 + sum(rank_reach(tree, a))


def best_tree_tokens(a: float, nodes: int, depth: int) -> float:
    """Expected tokens of the best tree of `nodes` nodes at most `depth` deep under the
    rank model. Values shrink from parent to child and from sibling to next sibling, so
    taking the top `nodes` values best-first yields a valid tree, and the best one."""
    total, heap, counter = 1.0, [(-a, 0, 1)], 0  # (-value, tie-break, depth) of candidates
    for _ in range(nodes):
        if not heap:
            break
        neg, _, d = heapq.heappop(heap)
        value = -neg
        total += value
        counter += 1
        heapq.heappush(heap, (-value * (1 - a), counter, d))  # next sibling
        if d < depth:
            counter += 1
            heapq.heappush(heap, (-value * a, counter, d + 1))  # first child
    return total


def tokens_per_s(
    expected: float, s: float, round_s: float, floor_s: float, pipeline_depth: int, queue_s: float = 0.0,
) -> float:
    """Committed tokens per second (module docstring): s the chance a round sent ahead
    is kept, round_s draft + traversal, floor_s the shortest launch interval (draft + Q),
    queue_s (Q) what each discarded round in flight costs the next fresh one."""
    # One round in flight is launched when the last returns: no floor, E / T.
    interval = round_s if pipeline_depth == 1 else max(round_s / pipeline_depth, floor_s)
    return expected / (round_s * (1 - s) + s * interval + (1 - s) * (pipeline_depth - 1) * queue_s)


def _shapes(config: AdaptConfig) -> list[tuple[DraftKind, int, int]]:
    shapes = []
    if DraftKind.CHAIN in config.kinds:
        shapes += [(DraftKind.CHAIN, k, k) for k in range(config.max_chain + 1)]
    if DraftKind.TREE in config.kinds:
        shapes += [(DraftKind.TREE, m, d) for m in config.tree_nodes for d in config.tree_depths if d < m]
    return shapes


def plan(state: AdaptState, config: AdaptConfig = AdaptConfig(), source: DraftSource = ALL_SOURCES) -> DraftShape:
    """The shape (and pipelining depth) with the most expected tokens per second.
    Ties keep the earlier shape in `_shapes` order: chains, then smaller trees."""
    a = acceptance_rate(state, source, config)
    fixed_s, per_row_s = traversal_line(state, config)
    best, best_rate = DraftShape(DraftKind.CHAIN, 0, 0, 1), -1.0
    for kind, nodes, depth in _shapes(config):
        expected = expected_tokens_chain(a, nodes) if kind is DraftKind.CHAIN else best_tree_tokens(a, nodes, depth)
        draft_s = state.draft_s_per_node * nodes
        round_s = draft_s + fixed_s + per_row_s * (nodes + 1)
        queue_s = state.queue_s if state.queue_s is not None else per_row_s * (nodes + 1)
        floor_s = draft_s + queue_s
        s = chain_survives(state, source, a, nodes) if kind is DraftKind.CHAIN else 0.0
        pipeline, rate = 1, tokens_per_s(expected, s, round_s, floor_s, 1)
        # Only a chain's round can be sent ahead: it is assumed accepted, and a round with
        # no draft or a tree (which path?) gives nothing to build the next one on.
        deepest = config.max_pipeline_depth if kind is DraftKind.CHAIN and nodes else 1
        while pipeline < deepest:
            deeper = tokens_per_s(expected, s, round_s, floor_s, pipeline + 1, queue_s)
            if deeper <= rate * (1 + config.min_pipeline_gain):
                break
            pipeline, rate = pipeline + 1, deeper
        if rate > best_rate:
            best, best_rate = DraftShape(kind, nodes, depth, pipeline), rate
    return best
