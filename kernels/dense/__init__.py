"""Dense math: batch-invariant GEMMs and row norms whose per-row bits never depend on M, and
the rotary position embedding in one launch."""
