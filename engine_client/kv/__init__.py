"""The engine's KV backends: baseline (all KV on the device), HiSparse (in-stream swap on the
service's memory, or remote swap), the local controls of baseline and embedded modes, the kernel
set and the index-key views."""
