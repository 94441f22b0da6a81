"""Trust: check every round's receipt chain, bundle a job's receipts, audit stages by replay.

Imports: coordinator.errors, coordinator.swarm.
"""
