"""The bookkeeping wing: who holds which pages, slots, sessions and prefix entries."""
