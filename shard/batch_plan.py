"""Which of the frames waiting at a stage run together in its next forward, and how many
rows of each (issue 21).

Pure: given the waiting frames in arrival order as (job id, rows left, splittable), it picks
the batch for Stage.forward_batch / StageWorker.process_frames under a token budget shared
by prefill chunks and decode rows, and cuts a long prefill chunk into consecutive pieces
while decode rows are about, so they never wait behind a whole chunk's forward. It never
waits for company: the batch is chosen from what is waiting now. Does not know tensors,
caches, the wire, clocks or how frames arrived.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Rows one forward may carry: one full prefill chunk (256 tokens, the coordinator's
# largest, coordinator.jobs.engine_config) plus 64 decode or verify rows beside it.
DEFAULT_TOKEN_BUDGET = 320
# Prefill rows one forward carries while decode rows are about. Measured on 10 of SmolLM2's
# 30 layers (one thread, this 2-core VM, load ~5): 16 decode rows alone 26 ms, with a
# 64-row piece beside them 86 ms, with a whole 256-row chunk 253 ms; pieces of 64 keep a
# forward that carries decode rows near 3x their own cost instead of ~10x
# (scripts/bench_batch.py: prefill_beside_decode in docs/results/bench_batch.json).
DEFAULT_PIECE_ROWS = 64


def plan_batch(waiting: Sequence[tuple[str, int, bool]], token_budget: int = DEFAULT_TOKEN_BUDGET,
               piece_rows: int = DEFAULT_PIECE_ROWS, busy: bool = False) -> list[tuple[int, int]]:
    """(index into `waiting`, rows to run now) of the frames to run next, in arrival order.

    `waiting`: (job id, rows still to run, splittable) in arrival order; splittable marks a
    prefill chunk that may run as consecutive pieces (a causal chunk computed piece by
    piece is the same maths: each piece attends to the cache rows the earlier ones wrote).

    The first frame always runs, even past the budget (alone, then): the oldest frame is
    never starved, and a frame larger than the budget still runs. Each later frame joins
    while its rows fit what is left, at most one frame per job (a job's next frame needs
    the K/V its earlier one writes), and never ahead of an earlier frame of its own job
    that was left waiting (or is part done). A frame that does not fit is passed over, not
    a wall: smaller frames behind it still join, and it is first once the frames ahead are
    done. Splitting: while decode rows wait (a frame that is not splittable and has rows)
    or `busy` (the caller saw decode rows lately), the splittable frames of one forward
    carry at most `piece_rows` rows together, the oldest first; otherwise a prefill chunk
    runs whole, so a lone job's prompt costs what it did. piece_rows 0: never split.
    """
    if not waiting:
        return []
    splitting = piece_rows > 0 and (busy or any(not split and rows for _, rows, split in waiting))
    left, prefill_left = token_budget, piece_rows if splitting else math.inf
    taken: list[tuple[int, int]] = []
    seen: set[str] = set()
    for i, (job_id, rows, split) in enumerate(waiting):
        if job_id in seen:
            continue  # taken, or behind its own job's frame that was passed over
        seen.add(job_id)
        if split and splitting:
            n = min(rows, prefill_left) if not taken else min(rows, prefill_left, left)
            prefill_left -= n
        else:
            n = rows if not taken or rows <= left else -1
        if n < 0 or (n == 0 and rows > 0):
            continue
        taken.append((i, n))
        left -= n
    return taken
