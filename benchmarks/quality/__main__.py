"""One entry for the quality protocol: each command runs a step of ``--protocol`` (its data in
``protocols/v<N>.json``), the rest of the line going to that step.

    python -m benchmarks.quality prepare  --protocol v3 --work W                     # the candidates' inputs
    python -m benchmarks.quality pretrain --protocol v3 --candidates --work W --seeds 42 --keep R
    python -m benchmarks.quality choose   --protocol v3 --work W --checkpoints R --choose F
    python -m benchmarks.quality pretrain --protocol v3 --work W --reuse --recipe k2   # the test phase's runs
    python -m benchmarks.quality score    --protocol v3 --work W --reuse --every-setting --output J
    python -m benchmarks.quality report   --output J
    python -m benchmarks.quality score    --quick --work /tmp/q                        # bookkeeping on tiny data
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.quality import protocol, search
from benchmarks.quality.spec import protocol as data
from benchmarks.quality.spec import versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["prepare", "choose", "pretrain", "score", "report"])
    parser.add_argument("--protocol", default="v3", choices=versions())
    parser.add_argument("--candidates", action="store_true", help="pretrain: the choice's candidates, not the test phase's runs")
    args, rest = parser.parse_known_args(argv)
    plan = data(args.protocol)
    if args.command == "prepare":
        return search.main(["prepare", *rest])
    if args.command == "pretrain" and args.candidates:
        return search.main(["pretrain", "--recipes", ",".join(plan["candidates"]), *rest])
    if args.command == "choose":
        return search.main(["evaluate", *rest])
    if args.command == "report":
        out = argparse.ArgumentParser(prog="report")
        out.add_argument("--output", required=True)
        protocol.print_report(json.loads(Path(out.parse_args(rest).output).read_text()))
        return 0
    extra = ["--pretrain-only"] if args.command == "pretrain" else []
    return protocol.main(["--protocol", args.protocol, *extra, *rest])


if __name__ == "__main__":
    sys.exit(main())
