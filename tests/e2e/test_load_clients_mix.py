"""The load benchmarks' closed-loop clients walk the whole request mix (scripts/load_clients.py).

Bug guarded: a client's k-th request was kind `(client + k * clients) % kinds`, so at a
concurrency that is a multiple of the mix's size each client sent one kind forever (at 16
streams over 8 kinds, two clients sent nothing but 1.9k-token prompts), and the mix at 16
streams was not the one a single client walks.
"""

from __future__ import annotations

from collections import Counter

from scripts.load_clients import kind_of, quiet_rate


def test_every_client_walks_every_kind_at_every_concurrency():
    for kinds in (6, 8):
        for clients in (1, 4, 8, 16, 32):
            for i in range(clients):
                assert {kind_of(i, k, kinds) for k in range(kinds)} == set(range(kinds)), (kinds, clients, i)
            sent = Counter(kind_of(i, k, kinds) for i in range(clients) for k in range(3 * kinds))
            assert len(set(sent.values())) == 1  # each kind equally often over whole walks


def test_clients_start_spread_over_the_mix():
    assert [kind_of(i, 0, 8) for i in range(16)] == [i % 8 for i in range(16)]


def test_quiet_rate_leaves_out_the_seconds_a_prompt_and_its_prefill_took():
    # Bug guarded: the steady decode rate mixing in the seconds after prompts arrived (where
    # prefill displaces decoding), or leaving out seconds long after them. Sound: hand-made.
    tokens = [100, 20, 30, 90, 110, 100, 10, 104]
    prompts = [0, 600, 0, 0, 0, 0, 200, 0]
    assert quiet_rate(tokens, prompts, after_s=2) == (100 + 110 + 100) / 3
    assert quiet_rate(tokens, prompts, after_s=0) == (100 + 30 + 90 + 110 + 100 + 104) / 6
    assert quiet_rate([5, 5], [1, 0], after_s=4) is None
