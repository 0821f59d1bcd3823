"""Writing KV: the append of new rows and index keys, and the fp8 row encoding."""
