"""Where the miss copy's cost to the decode step goes, from two bench.profile JSONs of the same
step: one with the copy and one with `--skip-copy` (issue 38 item 2).

    python -m bench.profile.copy_cost WITH.json SKIP.json

cost = step(with) - step(skip), split into
- interference: the main stream's kernels run longer beside the copy: (busy - copy) with the
  copy against busy without it (busy: kernel time summed over streams in the graph replay);
- exposure: the main stream waits for copies: its idle time (step - main-stream kernels) with
  the copy against without.
The two add up to the cost. Both rest on the profile's attribution (the graph replay's kernel
times; a kernel that overlaps itself across streams counts once per stream).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _copy_us(profile: dict) -> float:
    """The miss copy's kernel time per step in a profile (none with --skip-copy)."""
    return profile["categories"].get("miss copy", {}).get("us_per_step", 0.0)


def copy_cost(with_copy: dict, skip: dict) -> dict[str, float]:
    """The split in milliseconds, from the two profiles' JSON."""
    copy_us = _copy_us(with_copy)
    main_with = with_copy["busy_us_per_step"] - copy_us
    main_skip = skip["busy_us_per_step"] - _copy_us(skip)
    idle_with = with_copy["step_us"] - main_with
    idle_skip = skip["step_us"] - main_skip
    ms = lambda us: us / 1e3  # noqa: E731
    return {
        "step_ms": ms(with_copy["step_us"]),
        "step_skip_ms": ms(skip["step_us"]),
        "cost_ms": ms(with_copy["step_us"] - skip["step_us"]),
        "copy_kernel_ms": ms(copy_us),
        "interference_ms": ms(main_with - main_skip),
        "exposure_ms": ms(idle_with - idle_skip),
        "copy_over_pinned": with_copy.get("miss_copy_over_pinned") or 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("with_copy", type=Path, help="bench.profile JSON of the step with the copy")
    ap.add_argument("skip", type=Path, help="bench.profile JSON of the same step, --skip-copy")
    args = ap.parse_args(argv)
    c = copy_cost(json.loads(args.with_copy.read_text()), json.loads(args.skip.read_text()))
    print(
        f"step {c['step_ms']:.2f} ms, without the copy {c['step_skip_ms']:.2f} ms: "
        f"the copy costs {c['cost_ms']:.2f} ms = {c['interference_ms']:.2f} interference + "
        f"{c['exposure_ms']:.2f} exposure (copy kernels {c['copy_kernel_ms']:.2f} ms, "
        f"{c['copy_over_pinned']:.2f} of pinned in situ)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
