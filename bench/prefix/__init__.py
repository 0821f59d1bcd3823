"""Prefix sharing: capacity, tok/s, TTFT cached vs cold, multi-turn. Built on bench.e2e (its
sizing and load). cli: the command; plan: sizes and engine flags."""
