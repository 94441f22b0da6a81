"""What a refused node is told (issue 19): one line naming what to change.

Bugs guarded: a node with another model's store got a traceback; a second node started
with the first one's key silently replaced it (every request then hung while /health said
ok). Sound: the exact text is pinned, and the duplicate is refused, not the original.
"""

from __future__ import annotations

from coordinator.swarm.admission import refusal
from shard.wire.messages import Refused, Register


def register(digest: str) -> Register:
    return Register(peer_id="12D3KooWA", model="tiny-b", manifest_digest=digest, device="cpu", memory_bytes=1,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=1.0,
                    download_bytes_per_s=1.0)


def test_another_models_digest_is_refused_with_both_digests_and_the_model_to_pass():
    got = refusal(register("b" * 64), identity_in_use=False, model_name="tiny-a", model_digest="a" * 64)
    assert got == Refused(code="model_mismatch", reason=(
        f"this node holds model 'tiny-b' with digest {'b' * 64}, but the ring serves 'tiny-a' with digest {'a' * 64}: "
        "rejoin with --model tiny-a"))


def test_an_identity_another_running_node_registered_is_refused():
    got = refusal(register("a" * 64), identity_in_use=True, model_name="tiny-a", model_digest="a" * 64)
    assert got is not None and got.code == "duplicate_identity"
    assert got.reason == ("peer id 12D3KooWA is already registered by another running node: two nodes share one "
                          "identity key file; give each node its own --key-path (without --key-path each gets its own)")


def test_a_matching_node_with_a_fresh_identity_is_admitted():
    assert refusal(register("a" * 64), identity_in_use=False, model_name="tiny-a", model_digest="a" * 64) is None
