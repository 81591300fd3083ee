"""The protocol's recipe choice on dev gains and its every-setting endpoint on test scores: pure
functions on scores (no torch), used by ``benchmarks.quality choose`` and the test phase.

    choice = choose({"k2": {"sentiment/300/1": 4.2, ...}, ...}, {"k2": "k2", ...})
    write_choice(choice, Path("bench-results/quality-v3-choice.json"))
    frozen_choice(Path("bench-results/quality-v3-choice.json"), "k2")   # the test phase's check

A cell is (task, size, setting), named ``task/size/setting`` with the setting numbered 1-8 as
the protocol's grid table (the data's ``grid`` order).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

SETTINGS = 8
CHOICE_SIZES = ("300", "1000")
ENDPOINT_SIZES = ("100", "300", "1000")
MINIMUM_MARGIN = 1.0  # candidates whose minimum gain is within this of the largest stay in
MEAN_TIE = 0.5  # candidates left whose mean gain is within this of the largest tie


class ChoiceRefused(SystemExit):
    """A choice that cannot be made or a frozen choice that does not allow the run: one line;
    the command line prints it and exits with status 2, without a traceback."""


def cell(task: str, size: str | int, setting: int) -> str:
    """The name of a cell: ``task/size/setting`` (setting 1-8)."""
    return f"{task}/{size}/{setting}"


def cells(tasks: list[str], sizes: tuple[str, ...], settings: int = SETTINGS) -> list[str]:
    """Every cell of ``tasks`` x ``sizes`` x settings, in table order."""
    return [cell(t, s, k) for t in tasks for s in sizes for k in range(1, settings + 1)]


def gains(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, float]:
    """Per cell of ``a``: the mean of its scores (all runs and subsamples) minus the same mean for
    ``b``; a cell that ``b`` lacks is refused."""
    missing = sorted(set(a) - set(b))
    if missing:
        raise ChoiceRefused(f"no random-init scores for {len(missing)} cell(s), first {missing[0]}")
    return {c: statistics.fmean(v) - statistics.fmean(b[c]) for c, v in a.items()}


def choose(candidate_gains: dict[str, dict[str, float]], corpora: dict[str, str],
           expected: list[str] | None = None) -> dict:
    """The protocol's rule on each candidate's gains per cell (candidates in table order): the
    largest minimum gain; among candidates whose minimum is within :data:`MINIMUM_MARGIN` of it,
    the largest mean gain; candidates left whose mean is within :data:`MEAN_TIE` of that tie and
    the one higher in the table is chosen. Every candidate needs a gain in every ``expected``
    cell (by default the first candidate's cells)."""
    if not candidate_gains:
        raise ChoiceRefused("no candidate has a checkpoint to choose from")
    expected = expected or list(next(iter(candidate_gains.values())))
    rows = []
    for name, by_cell in candidate_gains.items():
        missing = [c for c in expected if c not in by_cell or math.isnan(by_cell[c])]
        if missing:
            raise ChoiceRefused(f"candidate {name} has no gain in {len(missing)} of the {len(expected)} cells, "
                                f"first {missing[0]}: its fine-tuning jobs are not all done")
        values = [by_cell[c] for c in expected]
        rows.append({"name": name, "corpus": corpora[name], "gains": {c: by_cell[c] for c in expected},
                     "minimum": min(values), "mean": statistics.fmean(values)})
    largest_minimum = max(r["minimum"] for r in rows)
    within = [r for r in rows if r["minimum"] >= largest_minimum - MINIMUM_MARGIN]
    largest_mean = max(r["mean"] for r in within)
    tied = [r for r in within if r["mean"] >= largest_mean - MEAN_TIE]
    chosen = tied[0]
    return {"name": chosen["name"], "corpus": chosen["corpus"],
            "rule": f"largest minimum gain over the {len(expected)} cells; among candidates within "
                    f"{MINIMUM_MARGIN} of it, the largest mean gain; a tie within {MEAN_TIE} goes to the "
                    "candidate higher in the table",
            "largest_minimum": largest_minimum, "within_minimum_margin": [r["name"] for r in within],
            "largest_mean_among_them": largest_mean, "tied_on_mean": [r["name"] for r in tied],
            "cells": expected, "candidates": rows}


def write_choice(choice: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=1) + "\n")


def frozen_choice(path: Path, recipe: str) -> dict:
    """The frozen choice in ``path``, when it names ``recipe``; refused in one line when the file
    is missing, unreadable or names another recipe."""
    path = Path(path)
    if not path.exists():
        raise ChoiceRefused(f"{path} is missing: the recipe choice is frozen (benchmarks.quality choose "
                            f"{path}, committed) before any test score of a candidate's checkpoint")
    try:
        choice = json.loads(path.read_text())
        name = choice["name"]
    except (ValueError, KeyError, TypeError):
        raise ChoiceRefused(f"{path} holds no recipe choice (JSON with a 'name'); write it again with "
                            "benchmarks.quality choose") from None
    if name != recipe:
        raise ChoiceRefused(f"{path} froze the recipe {name}, not {recipe}: run the test phase with --recipe {name}")
    return choice


# --------------------------------------------------------------------------- every-setting endpoint


def run_means(runs: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per cell, each run's mean over its subsamples (runs without the cell left out)."""
    out: dict[str, list[float]] = {}
    for run in runs:
        for c, values in run.items():
            if values:
                out.setdefault(c, []).append(statistics.fmean(values))
    return out


def every_setting_cells(a_runs: list[dict[str, list[float]]], b_runs: list[dict[str, list[float]]],
                        tasks: list[str], sizes: tuple[str, ...] = ENDPOINT_SIZES,
                        settings: int = SETTINGS) -> list[dict]:
    """The secondary endpoint: per cell of ``tasks`` x ``sizes`` x ``settings``, A - B
    macro-F1 with its Welch 95% interval over runs (a run's value is its mean over subsamples;
    ``a_runs``/``b_runs`` hold one dict per run, cell -> per-subsample scores). A negative gain
    is marked ``REGRESSION``; a cell without two runs on each side has NaN bounds."""
    from benchmarks.common import welch

    a, b = run_means(a_runs), run_means(b_runs)
    out = []
    for c in cells(tasks, sizes, settings):
        task, size, setting = c.split("/")
        row = {"cell": c, "task": task, "size": size, "setting": int(setting),
               "runs": [len(a.get(c, [])), len(b.get(c, []))]}
        if a.get(c) and b.get(c):
            row |= welch(a[c], b[c])
            row["flag"] = "REGRESSION" if row["gain"] < 0 else ""
        else:
            row |= {"gain": math.nan, "ci_low": math.nan, "ci_high": math.nan, "flag": "not run"}
        out.append(row)
    return out


def goal_every_setting(endpoint: list[dict], tasks: list[str], sizes: tuple[str, ...] = CHOICE_SIZES,
                       settings: int = SETTINGS) -> dict:
    """Goal 1: at ``sizes``, on every task and setting, the interval's lower end above 0. Passes
    only if every one of those cells does; the failing cells are listed (a missing cell fails)."""
    by_cell = {row["cell"]: row for row in endpoint}
    wanted = cells(tasks, sizes, settings)
    failing = []
    for c in wanted:
        low = by_cell.get(c, {}).get("ci_low", math.nan)
        if math.isnan(low) or low <= 0:
            failing.append(c)
    return {"goal": "every setting", "cells": len(wanted), "passed_cells": len(wanted) - len(failing),
            "pass": not failing, "failing": failing}
