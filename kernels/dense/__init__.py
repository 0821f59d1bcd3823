"""Batch-invariant dense math: GEMMs and row norms whose per-row bits never depend on M."""
