"""Nodes started on one machine without --key-path get distinct identities (issue 19).

Bug guarded: every node defaulted to <cache>/node.key, so a second node silently took the
first one's identity (the coordinator then saw one peer; every request hung while /health
said ok). Sound: flock conflicts between open file descriptions even in one process, so
two claims here behave as two processes' claims would.
"""

from __future__ import annotations

import os

from shard.identity import claim_key_path


def test_concurrent_claims_get_distinct_keys_and_a_released_key_is_claimed_again(tmp_path):
    first, fd1 = claim_key_path(tmp_path, "node")
    second, fd2 = claim_key_path(tmp_path, "node")
    assert (first.name, second.name) == ("node.key", "node-1.key")
    os.close(fd1)  # the first node stopped: a node started now takes its identity back
    again, fd3 = claim_key_path(tmp_path, "node")
    assert again == first
    os.close(fd2)
    os.close(fd3)
