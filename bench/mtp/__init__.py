"""Speculative decoding (MTP) vs plain decoding. Built on bench.e2e (its runs and children).
cli: the command; report: tables; draft_replay: the recorded greedy run the engine replays as
drafts (`--draft-source bench.mtp.draft_replay:replay_source`)."""
