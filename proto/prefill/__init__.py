"""prefill.v1: the prefill engine of prefill/decode disaggregation."""
