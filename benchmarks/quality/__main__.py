"""One entry for the quality protocol: each command runs a step of ``--protocol`` (its data in
``protocols/v<N>.json``), the rest of the line going to that step.

    python -m benchmarks.quality prepare  --protocol v3 --work W                     # the candidates' inputs
    python -m benchmarks.quality pretrain --protocol v3 --candidates --work W --seeds 42 --keep R
    python -m benchmarks.quality choose   --protocol v3 --work W --checkpoints R --choose F
    python -m benchmarks.quality pretrain --protocol v3 --work W --reuse --recipe k2   # the test phase's runs
    python -m benchmarks.quality score    --protocol v3 --work W --reuse --every-setting --output J
    python -m benchmarks.quality report   --output J [--expect docs/quality-v3.json]
    python -m benchmarks.quality score    --quick --work /tmp/q                        # bookkeeping on tiny data
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.quality import protocol, search
from benchmarks.quality.spec import versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["prepare", "choose", "pretrain", "score", "report"])
    parser.add_argument("--protocol", default="v3", choices=versions())
    parser.add_argument("--candidates", action="store_true", help="pretrain: the choice's candidates, not the test phase's runs")
    args, rest = parser.parse_known_args(argv)
    if args.command in ("prepare", "choose") or (args.command == "pretrain" and args.candidates):
        return search.main([args.command, "--protocol", args.protocol, *rest])
    if args.command == "report":
        out = argparse.ArgumentParser(prog="report")
        out.add_argument("--output", required=True)
        out.add_argument("--expect", help="a committed result: exit 1 unless --output has its numbers and ran no job")
        given = out.parse_args(rest)
        result = read_result(given.output, out)
        protocol.print_report(result)
        return 0 if given.expect is None else reproduced(result, read_result(given.expect, out))
    extra = ["--pretrain-only"] if args.command == "pretrain" else []
    return protocol.main(["--protocol", args.protocol, *extra, *rest])


def read_result(path: str, parser: argparse.ArgumentParser) -> dict:
    """A protocol's result file, or one line saying why it is not one (exit 2)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        parser.error(f"{path}: not a readable JSON file ({err})")
    missing = [k for k in ("machine", "protocol", "tasks", "arms", "endpoints", "cache") if k not in result]
    if missing:
        parser.error(f"{path}: not a quality protocol's result (no {', '.join(missing)}); give the JSON that "
                     "`benchmarks.quality score --output` writes")
    return result


def reproduced(result: dict, expected: dict) -> int:
    """0 when ``result`` ran no job and its endpoints, cells and goals equal ``expected``'s."""
    differ = [k for k in ("endpoints", "every_setting", "goals")  # as text: NaN equals NaN
              if json.dumps(result.get(k), sort_keys=True) != json.dumps(expected.get(k), sort_keys=True)]
    computed = result["cache"]["computed"]
    print(f"against the committed result: {computed} jobs run; " + (f"differ: {', '.join(differ)}" if differ
                                                                     else "endpoints, cells and goals the same"))
    return 1 if differ or computed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)  # a refusal: its one line, and bad input's status, as the product's CLI
        sys.exit(2)
