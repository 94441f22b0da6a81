"""Exact split of a model's layers over a chosen set of nodes (order does not matter).

Minimises  sum_i k_i * w_i + extra_chunks * max(floor, max_i u_i, max_i k_i * q_i)
subject to sum_i k_i = L and 1 <= k_i <= cap_i  (the k-dependent part of ring.cost).

For a fixed bottleneck bound B the sum is minimised greedily (every node gets one layer,
the rest go to the cheapest w first, each up to min(cap, B / q)), which is exact for a
separable linear cost under box constraints. The optimum's bottleneck is one of the
values {floor, u_i, k * q_i}, so trying those B in ascending order, and stopping once
extra_chunks * B alone exceeds the best cost found, is exact. Knows nothing of latency,
order, peers or trust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ring.cost import NodeTerms

# Guards floor(B / q) when B was computed as k * q and rounds a hair below it.
_RATIO_SLACK = 1e-9


@dataclass(frozen=True)
class Allocation:
    cost_s: float
    layers: tuple[int, ...]  # per node, in the order the terms were given
    bottleneck_s: float


def _greedy(order: Sequence[int], w: Sequence[float], upper: Sequence[int], num_layers: int) -> tuple[float, list[int]]:
    layers = [1] * len(w)
    left = num_layers - len(w)
    cost = sum(w)
    for i in order:  # cheapest per-layer cost first
        if left == 0:
            break
        take = min(upper[i] - 1, left)
        layers[i] += take
        cost += take * w[i]
        left -= take
    return cost, layers


def allocate(terms: Sequence[NodeTerms], num_layers: int, extra_chunks: int, floor_s: float) -> Allocation | None:
    """The optimal layer counts for these nodes, or None if they cannot hold the model."""
    n = len(terms)
    caps = [t.cap_layers for t in terms]
    if n == 0 or n > num_layers or min(caps) < 1 or sum(caps) < num_layers:
        return None
    w = [t.per_layer_s for t in terms]
    q = [t.chunk_per_layer_s for t in terms]
    order = sorted(range(n), key=lambda i: (w[i], i))
    base_s = max(floor_s, max(t.chunk_send_s for t in terms))

    def bottleneck(layers: Sequence[int]) -> float:
        return max(base_s, max(k * qi for k, qi in zip(layers, q)))

    loose_sum, loose_layers = _greedy(order, w, caps, num_layers)
    if extra_chunks == 0:
        return Allocation(loose_sum, tuple(loose_layers), bottleneck(loose_layers))
    best = Allocation(loose_sum + extra_chunks * bottleneck(loose_layers), tuple(loose_layers), bottleneck(loose_layers))
    bounds = sorted({base_s, *(k * q[i] for i in range(n) if q[i] > 0 for k in range(1, caps[i] + 1) if k * q[i] > base_s)})
    for bound in bounds:
        if extra_chunks * bound + loose_sum >= best.cost_s:
            break  # the sum can never drop below loose_sum, so no larger bound can win
        upper = [caps[i] if q[i] == 0 else min(caps[i], math.floor(bound / q[i] + _RATIO_SLACK)) for i in range(n)]
        if min(upper) < 1 or sum(upper) < num_layers:
            continue
        total, layers = _greedy(order, w, upper, num_layers)
        actual = bottleneck(layers)
        cost = total + extra_chunks * actual
        if cost < best.cost_s:
            best = Allocation(cost, tuple(layers), actual)
    return best
