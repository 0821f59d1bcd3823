"""The kit: the set of kernels a process launches, over every op family (KernelSet)."""
