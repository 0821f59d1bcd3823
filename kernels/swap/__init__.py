"""Swap-in: the plan (hits, LRU victims, slot list, miss list) and the miss copy."""
