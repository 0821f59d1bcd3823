"""A benchmark's JSON result file, written whole or not at all: the families rewrite theirs after
every finished run, so a stage killed by its time limit mid-write keeps the previous file."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(payload: dict, path: Path) -> None:
    """`payload` to `path` (parents made) through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)
