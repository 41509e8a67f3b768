"""Speculative decoding: drafting, verification and token acceptance."""
