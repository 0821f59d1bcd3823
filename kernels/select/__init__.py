"""Choosing rows: the lightning indexer's scores and the top-k selection."""
