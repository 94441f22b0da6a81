"""Which finished jobs' K/V the ring's stages keep for later requests (the prefix cache).

Chat traffic resends what a ring has already computed: the template's system prompt, the
same document, and every earlier turn of a conversation. A job that ends on a ring can be
kept as a *source*: its EndJob says keep (shard.wire.messages), so each stage keeps its K/V,
and a later job whose prompt starts with the same tokens on the same ring epoch names it
in its first frame (Forward.prefix_job, prefix_len): every stage copies those slots and the
job prefills only the rest (shard.kvcache.KVCache.fork). This index decides which sources
exist and which one a new prompt uses: the longest common prefix of token ids with any
source of the job's epoch, at least `min_tokens` long and short of the whole prompt by one
token (the root a round must feed). Sources are bounded by count and by tokens (what the
stages hold for them), least recently used go first, and one unused for `idle_s` goes
(below a stage's own idle eviction, shard.stage_worker.WorkerConfig.job_idle_timeout_s,
which a fork resets). A source is a job that computed all its K/V itself (no fork): an
audit of a fork replays the source's frames, never a chain of them (docs/prefix_cache.md).

Pure bookkeeping over token ids and a clock: it sends nothing (the engine sends the EndJob
of what it evicts) and knows no stages, frames or receipts.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Source:
    """A finished job whose K/V every stage of its ring epoch still holds."""

    job_id: str
    epoch: int
    ring_id: int
    tokens: tuple[int, ...]  # the tokens whose K/V sits at slots [0, len) on every stage
    slots: int  # K/V slots its cache holds on each stage (what a ring's room counts)
    drafters: tuple = ()  # its drafters that read the target's features (EAGLE), to fork from
    last_used_s: float = 0.0
    hits: int = 0


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0  # prompt tokens no stage computed again
    kept: int = 0  # jobs kept as sources
    evicted: int = 0  # sources ended (least recently used, idle, for room, or their ring gone)


@dataclass
class PrefixIndex:
    max_tokens: int  # the tokens all sources together hold (0: the cache is off)
    min_tokens: int = 32  # the shortest prefix worth a fork (and a source worth keeping)
    max_sources: int = 64
    idle_s: float = 240.0
    clock: Callable[[], float] = time.monotonic
    sources: OrderedDict[str, Source] = field(default_factory=OrderedDict)  # least recently used first
    stats: PrefixStats = field(default_factory=PrefixStats)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sources.values())

    def lookup(self, epoch: int, prompt: Sequence[int]) -> tuple[Source, int] | None:
        """The source of `epoch` sharing the longest prefix with `prompt`, and how many of its
        tokens to take (at most len(prompt) - 1); None below min_tokens. A hit counts as use."""
        if not self.enabled:
            return None
        self.stats.lookups += 1
        best, best_len = None, 0
        for src in self.sources.values():
            if src.epoch == epoch and src.tokens[:1] == tuple(prompt[:1]):
                n = common_prefix(src.tokens, prompt)
                if n > best_len:
                    best, best_len = src, n
        take = min(best_len, len(prompt) - 1)
        if best is None or take < self.min_tokens:
            return None
        best.last_used_s, best.hits = self.clock(), best.hits + 1
        self.sources.move_to_end(best.job_id)
        self.stats.hits += 1
        self.stats.tokens_reused += take
        return best, take

    def add(self, source: Source) -> tuple[bool, list[Source]]:
        """Keep `source` (a job that just ended); (whether it is kept, the sources that must
        end now to stay within bounds). Not kept: the cache is off, it is too short or longer
        than the whole bound, or a source of its epoch already holds all its tokens."""
        if (not self.enabled or len(source.tokens) < self.min_tokens or len(source.tokens) > self.max_tokens
                or source.job_id in self.sources):
            return False, []
        for src in self.sources.values():  # (one without the drafters' state it has is no duplicate)
            if (src.epoch == source.epoch and common_prefix(src.tokens, source.tokens) == len(source.tokens)
                    and len(src.drafters) >= len(source.drafters)):
                return False, []
        source.last_used_s = self.clock()
        self.sources[source.job_id] = source
        self.stats.kept += 1
        gone = []
        while len(self.sources) > self.max_sources or self.tokens > self.max_tokens:
            gone.append(self.sources.popitem(last=False)[1])
        self.stats.evicted += len(gone)
        return True, gone

    def expire(self) -> list[Source]:
        """The sources unused for idle_s, removed."""
        now = self.clock()
        return self._remove([s for s in self.sources.values() if now - s.last_used_s > self.idle_s])

    def drop(self, job_id: str) -> list[Source]:
        """Source `job_id` (if kept), removed: a stage no longer holds it."""
        return self._remove([s for s in self.sources.values() if s.job_id == job_id])

    def drop_ring(self, ring_id: int) -> list[Source]:
        """Every source on ring `ring_id`, removed (its stages need the room)."""
        return self._remove([s for s in self.sources.values() if s.ring_id == ring_id])

    def drop_epochs(self, live: Callable[[int], bool]) -> list[Source]:
        """Every source whose epoch is no longer a formed ring's, removed (its stages dropped it)."""
        return self._remove([s for s in self.sources.values() if not live(s.epoch)])

    def slots_on(self, ring_id: int) -> list[int]:
        return [s.slots for s in self.sources.values() if s.ring_id == ring_id]

    def info(self) -> dict:
        st = self.stats
        return {"max_tokens": self.max_tokens, "sources": len(self.sources), "tokens": self.tokens,
                "lookups": st.lookups, "hits": st.hits, "tokens_reused": st.tokens_reused, "kept": st.kept,
                "evicted": st.evicted}

    def _remove(self, gone: list[Source]) -> list[Source]:
        for s in gone:
            del self.sources[s.job_id]
        self.stats.evicted += len(gone)
        return gone


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return len(os.path.commonprefix([list(a), list(b)]))
