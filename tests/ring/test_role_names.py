"""ring.RoleKind and the wire's role names are one table seen from two packages."""

from ring import RoleKind
from shard.wire.roles import ROLE_NAMES, ROLE_STAGE


def test_role_kinds_are_exactly_the_wire_role_names():
    # Bug guarded: a role added or renamed on one side only, so the coordinator sends a
    # name no node knows or cannot convert a name it reads back. Sound: compares the two
    # complete sets, and both are declared once.
    assert sorted(k.value for k in RoleKind) == sorted(ROLE_NAMES)
    assert len(set(ROLE_NAMES)) == len(ROLE_NAMES)
    assert RoleKind(ROLE_STAGE) is RoleKind.STAGE
