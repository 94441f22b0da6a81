"""How a prompt is cut into prefill chunks for the ring: a pure plan of frame boundaries.

Chunks travel the ring back to back (chunk c+1 leaves while chunk c is still in the
ring). While the first chunk crosses the stages one by one the pipeline is filling, and
while the last one does it is draining; in both phases most stages have nothing to do,
and both last in proportion to those two chunks' sizes (compute plus serialisation on
every hop). Every frame also has a fixed cost (headers, receipts, a thread hand-off per
stage), which large chunks amortise. So chunks ramp up from a small first one, stay
large in the middle, and ramp down to a small last one.

It does not know stages, links or timing; the engine sends what it plans.
"""

from __future__ import annotations


def prefill_chunks(start: int, end: int, max_tokens: int, edge_tokens: int) -> list[tuple[int, int]]:
    """Half-open chunks [a, b) covering positions [start, end) in order: sizes double from
    `edge_tokens` up to `max_tokens`, stay there, then halve back down to `edge_tokens`.

    A ramp step is taken only while a full `max_tokens` chunk still fits between the two
    ramps, so anything up to `max_tokens` tokens is one frame, and `edge_tokens >=
    max_tokens` gives plain fixed-size chunks. The middle is split evenly (sizes differ by
    at most one token) rather than leaving a runt chunk at the end."""
    if max_tokens < 1 or edge_tokens < 1:
        raise ValueError(f"chunk sizes must be >= 1, got max {max_tokens}, edge {edge_tokens}")
    n = end - start
    if n <= 0:
        return []
    ramp: list[int] = []
    size = min(edge_tokens, max_tokens)
    while size < max_tokens and n - 2 * (sum(ramp) + size) >= max_tokens:
        ramp.append(size)
        size *= 2
    middle = n - 2 * sum(ramp)
    parts = -(-middle // max_tokens)  # ceil
    body = [middle // parts + (1 if i < middle % parts else 0) for i in range(parts)]
    bounds, a = [], start
    for size in ramp + body + ramp[::-1]:
        bounds.append((a, a + size))
        a += size
    return bounds
