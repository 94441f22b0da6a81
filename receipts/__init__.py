"""Signed receipts proving every layer of a model ran for a request.

Pure: schema, canonical bytes, digests, Ed25519 keys, sign and verify, spot-check
comparison. Knows nothing of networking, torch, rings or HTTP.
"""
