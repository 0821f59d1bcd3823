"""The memory wing: the KV tensors, their shared segments and files, the remote-swap exchange."""
