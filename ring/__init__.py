"""Who serves which layers in which order: cost model, ring selection, roles, churn.

Decisions are pure functions of data; nothing here opens a socket or touches torch.
"""

from ring.churn import ChurnPolicy, fetch_seconds, plan_moves, reselect, with_moves
from ring.cost import evaluate, max_layers
from ring.assign import Capacity, speed_bands, split_by_capacity
from ring.errors import AssignError, InfeasibleError, InvalidInputError, RingError, UnknownPeerError
from ring.network import LatencyMatrix, Network, NodeInfo, PeerId
from ring.oracle import oracle_ring
from ring.plan import Hop, Move, Plan, Role, RoleKind, Stage, StageTiming
from ring.roles import RolePolicy, assign_roles
from ring.search import Constraints, select_ring
from ring.spec import ModelSpec, Workload

__all__ = [
    "AssignError", "Capacity", "ChurnPolicy", "Constraints", "Hop", "InfeasibleError", "InvalidInputError", "LatencyMatrix", "ModelSpec",
    "Move", "Network", "NodeInfo", "PeerId", "Plan", "RingError", "Role", "RoleKind", "RolePolicy", "Stage",
    "StageTiming", "UnknownPeerError", "Workload", "assign_roles", "evaluate", "fetch_seconds", "max_layers", "oracle_ring",
    "plan_moves", "reselect", "select_ring", "speed_bands", "split_by_capacity", "with_moves",
]
