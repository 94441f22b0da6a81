"""Role names an Assignment may carry: the one table of them.

The wire keeps roles as plain strings; `ring.RoleKind`'s values are these names (a test
holds the two together), and the coordinator converts at that boundary. Knows nothing of
what a role does or who is given one (ring.roles decides that).
"""

ROLE_STAGE = "stage"  # a ring member; every other role serves no ring frames that epoch
ROLE_HOT_STANDBY = "hot_standby"  # keeps a stage's slice warm to take it over
ROLE_SPOT_CHECK_VERIFIER = "spot_check_verifier"  # recomputes sampled frames of a stage
ROLE_WEIGHT_SEEDER = "weight_seeder"  # serves layer files to nodes that lack them
ROLE_RELAY = "relay"  # forwards for unreachable nodes

# A node that holds the whole model is a one-stage ring of its own (coordinator.swarm.ring_set),
# not a role: "decode_only_replica" is gone.
ROLE_NAMES = (ROLE_STAGE, ROLE_HOT_STANDBY, ROLE_SPOT_CHECK_VERIFIER, ROLE_WEIGHT_SEEDER, ROLE_RELAY)
