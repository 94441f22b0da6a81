"""Which of the frames waiting at a stage run together in its next forward (issue 21).

Pure: given the waiting frames in arrival order as (job id, rows), it picks the batch for
Stage.forward_batch / StageWorker.process_frames under a token budget shared by prefill
chunks and decode rows. It never waits for company: the batch is chosen from what is
waiting now. Does not know tensors, caches, the wire or how frames arrived.
"""

from __future__ import annotations

from collections.abc import Sequence

# Rows one forward may carry: one full prefill chunk (256 tokens, the coordinator's
# largest, coordinator.jobs.engine_config) plus 64 decode or verify rows beside it, so a
# long prompt's chunk shares its forward with the decode rounds instead of stalling them.
DEFAULT_TOKEN_BUDGET = 320


def take_batch(waiting: Sequence[tuple[str, int]], token_budget: int = DEFAULT_TOKEN_BUDGET) -> list[int]:
    """Indices into `waiting` ((job id, rows) in arrival order) of the frames to run next.

    The first frame always runs, even past the budget (alone, then): the oldest frame is
    never starved, and a frame larger than the budget still runs. Each later frame joins
    while its rows fit what is left, at most one frame per job (a job's next frame needs
    the K/V its earlier one writes), and never ahead of an earlier frame of its own job
    that was left waiting. A frame that does not fit is passed over, not a wall: smaller
    frames behind it still join, and it is first (so runs) once the frames ahead are done.
    """
    if not waiting:
        return []
    first_job, left = waiting[0][0], token_budget - waiting[0][1]
    taken, seen = [0], {first_job}
    for i, (job_id, rows) in enumerate(waiting[1:], start=1):
        if job_id in seen:
            continue  # taken, or behind its own job's frame that was passed over
        seen.add(job_id)
        if rows <= left:
            taken.append(i)
            left -= rows
    return taken
