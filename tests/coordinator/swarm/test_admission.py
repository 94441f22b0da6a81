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


# -- registration rate (issue 20) -------------------------------------------------------------

def test_an_address_minting_fresh_keys_and_a_key_rejoining_are_refused_past_their_rate():
    # Bug guarded: a fresh key seated 7 s after its predecessor was excluded, over and over
    # (each starts a probation the coordinator pays for). Sound: exact times against a
    # stated policy; the refusal names what, how often, the limit and when to retry.
    from coordinator.swarm.admission import RegistrationLimits, rate_refusal

    limits = RegistrationLimits(per_address=3, per_key=2, window_s=60.0)
    by_address = {"203.0.113.7": [0.0, 10.0, 20.0]}
    refused = rate_refusal("203.0.113.7", "fresh-key", by_address, {}, 30.0, limits)
    assert refused is not None and refused.code == "rate_limited"
    assert refused.reason == ("this address (203.0.113.7) registered 3 times in the last 60 s, the limit: "
                              "retry in 30 s")
    assert rate_refusal("203.0.113.7", "fresh-key", by_address, {}, 60.0, limits) is None  # the first fell out
    by_key = {"k": [50.0, 55.0]}
    refused = rate_refusal("198.51.100.1", "k", {}, by_key, 56.0, limits)
    assert refused is not None and "this identity (k) registered 2 times" in refused.reason
    assert rate_refusal(None, "other", by_address, by_key, 30.0, limits) is None  # no address: by key alone


def test_the_swarm_history_counts_admitted_registrations_and_stays_bounded():
    import trio
    import trio.testing

    from coordinator.swarm.admission import RegistrationLimits, RegistrationRate

    async def main():
        rate = RegistrationRate(RegistrationLimits(per_address=2, per_key=5, window_s=10.0), max_names=3)
        assert rate.admit("a", "10.0.0.1") is None and rate.admit("b", "10.0.0.1") is None
        assert rate.admit("c", "10.0.0.1").code == "rate_limited"  # refused: not counted
        await trio.sleep(10.0)
        assert rate.admit("c", "10.0.0.1") is None
        for key in "defg":
            rate.admit(key, None)
        return rate

    rate = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(rate.by_key) == 3 and list(rate.by_key) == ["e", "f", "g"]
    assert rate.by_address == {"10.0.0.1": [10.0]}
