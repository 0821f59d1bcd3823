"""Prefill/decode disaggregation benchmark (issue 42): `python -m bench.disagg`."""
