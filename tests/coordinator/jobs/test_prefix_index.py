"""The prefix cache's index (coordinator.jobs.prefix_cache), pure.

Bugs guarded: a fork taking the whole prompt (no root left for the round to feed), a source
of another ring epoch (whose stages never held it), a prefix shorter than the minimum, not
the longest match, bounds exceeded (count, tokens) or the wrong source evicted (not the least
recently used), an idle source kept past idle_s, a duplicate kept beside a source that
already holds all its tokens, the cache off still answering.
"""

from __future__ import annotations

from coordinator.jobs.prefix_cache import PrefixIndex, Source, common_prefix

A = tuple(range(100, 140))  # 40 tokens


def src(job: str, tokens, epoch: int = 1, ring: int = 0) -> Source:
    return Source(job, epoch, ring, tuple(tokens), slots=256)


def test_lookup_takes_the_longest_match_of_the_epoch_short_of_the_whole_prompt():
    now = [0.0]
    index = PrefixIndex(max_tokens=1000, min_tokens=8, clock=lambda: now[0])
    assert index.add(src("a", A[:20]))[0] and index.add(src("b", A))[0]
    assert index.add(src("other", A + (1, 2), epoch=2))[0]
    source, n = index.lookup(1, list(A[:30]) + [7, 7])
    assert (source.job_id, n) == ("b", 30)
    source, n = index.lookup(1, list(A))  # the same prompt: all but its last token
    assert (source.job_id, n) == ("b", 39)
    assert index.lookup(1, list(A[:5]) + [1] * 20) is None  # 5 < min_tokens
    assert index.lookup(3, list(A)) is None  # no source on that epoch
    assert index.stats.hits == 2 and index.stats.tokens_reused == 69 and index.sources["b"].hits == 2


def test_bounds_evict_the_least_recently_used():
    index = PrefixIndex(max_tokens=100, min_tokens=8, max_sources=3)
    for job, start in (("a", 0), ("b", 1000), ("c", 2000)):
        assert index.add(src(job, range(start, start + 30))) == (True, [])
    index.lookup(1, list(range(0, 30)) + [5])  # "a" used: "b" is now the oldest
    kept, gone = index.add(src("d", range(3000, 3030)))
    assert kept and [s.job_id for s in gone] == ["b"] and index.tokens == 90
    kept, gone = index.add(src("e", range(4000, 4050)))  # 140 tokens: two must go
    assert kept and [s.job_id for s in gone] == ["c", "a"] and list(index.sources) == ["d", "e"]
    assert index.add(src("huge", range(101))) == (False, [])  # longer than the whole bound
    assert index.add(src("short", range(5))) == (False, [])
    assert index.stats.evicted == 3


def test_idle_sources_expire_and_duplicates_are_not_kept():
    now = [0.0]
    index = PrefixIndex(max_tokens=1000, min_tokens=8, idle_s=240.0, clock=lambda: now[0])
    index.add(src("a", A))
    assert index.add(src("same", A)) == (False, []) and index.add(src("shorter", A[:30])) == (False, [])
    assert index.add(src("elsewhere", A, epoch=2))[0]  # another epoch's stages hold nothing of "a"
    now[0] = 200.0
    index.lookup(1, list(A) + [1])
    now[0] = 300.0
    assert [s.job_id for s in index.expire()] == ["elsewhere"] and list(index.sources) == ["a"]
    assert [s.job_id for s in index.drop_ring(0)] == ["a"] and not index.sources


def test_the_cache_off_keeps_and_finds_nothing():
    index = PrefixIndex(max_tokens=0)
    assert index.add(src("a", A)) == (False, []) and index.lookup(1, list(A)) is None
    assert common_prefix((1, 2, 3), [1, 2, 4, 5]) == 2 and common_prefix((), [1]) == 0
