"""serve/restore.py: a request rebuilt from the state file after an engine restart is the request
that was saved, its cache salt included (the salt names its pages' namespace at release: a
resumed request without it would offer its pages to every tenant)."""

from __future__ import annotations

from engine_client.client.control import HeldRequest
from engine_client.loop import state_file
from engine_client.loop.request import GenRequest, SamplingParams
from engine_client.serve.restore import resumed


def test_a_resumed_request_keeps_its_cache_salt(tmp_path) -> None:
    req = GenRequest("r1", (5, 6, 7), 8, SamplingParams(), cache_salt="tenant-a")
    req.tokens = [9, 10]
    path = str(tmp_path / "state.jsonl")
    state_file.StateFile(path).rewrite("s1", 1, [req])
    saved = state_file.load(path).requests["r1"]
    held = HeldRequest("r1", slot=2, mode=1, seq_len=4, prompt_len=3, max_new_tokens=8)
    again = resumed(held, saved, None)
    assert again is not None
    assert (again.cache_salt, again.slot, again.tokens) == ("tenant-a", 2, [9, 10])
