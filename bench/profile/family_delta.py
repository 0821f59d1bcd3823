"""Two bench.profile JSONs of the same step side by side: the step, its device timeline and
every kernel family, with the change from the first to the second, largest first. For same-call
A/B profiles (a launch option against the default: `--torch-glue`, `--late-queries`, ...), where
the question is which kernels moved and whether the step followed them.

    python -m bench.profile.family_delta A.json B.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_TIMELINE = ("model_us", "copy_us", "copy_alone_us", "idle_us")


def rows(a: dict, b: dict) -> list[tuple[str, float, float]]:
    """(name, A ms, B ms): the step, the timeline's terms (if both have them), then the kernel
    families of either, by the size of their change (a family one profile lacks counts 0)."""
    ms = lambda us: (us or 0.0) / 1e3  # noqa: E731
    out = [("step (timed)", ms(a["step_us"]), ms(b["step_us"]))]
    ta, tb = a.get("timeline") or {}, b.get("timeline") or {}
    for key in _TIMELINE if ta and tb else ():
        out.append((f"timeline: {key[:-3].replace('_', ' ')}", ms(ta[key]), ms(tb[key])))
    fa, fb = a.get("families") or {}, b.get("families") or {}
    fams = [
        (name, ms(fa.get(name, {}).get("us_per_step")), ms(fb.get(name, {}).get("us_per_step")))
        for name in sorted(set(fa) | set(fb))
    ]
    return out + sorted(fams, key=lambda r: -abs(r[2] - r[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a", type=Path, help="bench.profile JSON (the reference)")
    ap.add_argument("b", type=Path, help="bench.profile JSON of the same step, one option changed")
    args = ap.parse_args(argv)
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    print(f"{'':48} {'A ms':>9} {'B ms':>9} {'B - A':>9}")
    for name, x, y in rows(a, b):
        print(f"{name[:48]:48} {x:9.3f} {y:9.3f} {y - x:+9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
