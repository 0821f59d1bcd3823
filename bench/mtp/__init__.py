"""Speculative decoding (MTP) vs plain decoding, at BENCHMARK-ONLY synthetic acceptance rates.
Built on bench.e2e (its runs and children). cli: the command and its run matrix; report: the
numbers, the table and the JSON."""
