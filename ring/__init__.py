"""Who serves which layers in which order: cost model, ring selection, roles, churn.

Decisions are pure functions of data; nothing here opens a socket or touches torch.
"""
