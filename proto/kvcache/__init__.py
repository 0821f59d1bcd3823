"""kvcache.v1: the KV service control plane."""
