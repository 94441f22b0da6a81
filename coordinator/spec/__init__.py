"""Speculation: draft trees, drafters (n-gram, EAGLE-3), acceptance, sampling, the planner.

Pure computation on tokens, logits and measurements: no trio, no ring, no streams.
Imports: coordinator.errors.
"""
