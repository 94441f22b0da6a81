"""Speculation: draft trees and their sources, drafters (n-gram, EAGLE-3), acceptance,
sampling, the planner; offline, the EAGLE head's captured data and fitting maths, and
drafts replayed against known text.

Pure computation on tokens, logits and measurements: no trio, no ring, no streams.
Imports: coordinator.errors.
"""
