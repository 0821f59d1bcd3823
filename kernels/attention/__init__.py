"""Sparse MLA decode attention: `sparse.sparse_mla_decode` and the kernels behind it."""
