"""The plan against real runs on the sample: every stage will run on a fresh root, the data stages'
estimated wall time within 2x of their measured wall time, cached after they ran, and planning
writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from typer.testing import CliRunner

from bert_core.plan import parse_assumed
from flows.cli.main import app
from flows.cli.plan import make_plan


def _files(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_size) for p in root.rglob("*")) if root.exists() else []


def _stage(command: list[str], config: Path) -> float:
    """Wall seconds of one stage run as a user runs it: ``bertpipe <stage>`` in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flows.cli", *command, "--config", str(config), "--workers", "1"],
                   check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def test_plan_follows_the_stages_and_estimates_their_time(samples_dir, make_pipeline_config, tmp_path):
    root = tmp_path / "data"
    cfg = make_pipeline_config(samples_dir, root, "workers=1")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    fresh = make_plan(cfg)
    assert [s["status"] for s in fresh["stages"]] == ["will run"] * 5
    assert [s["version"] is None for s in fresh["stages"][:4]] == [False, True, True, True]
    assert not root.exists(), "planning wrote under the storage root"

    # Each stage into the folder the plan names; the next stage's version is known once it ran.
    ratios = {}
    corpus = fresh["stages"][0]["output"]
    measured = _stage(["corpus", "--output", corpus], config)
    ratios["corpus"] = fresh["stages"][0]["estimate"]["wall_hours"] * 3600 / measured
    vocab = make_plan(cfg)["stages"][1]
    measured = _stage(["vocab", "--corpus", corpus, "--output", vocab["output"]], config)
    ratios["vocab"] = vocab["estimate"]["wall_hours"] * 3600 / measured
    instances = make_plan(cfg)["stages"][2]
    measured = _stage(["instances", "--corpus", corpus, "--vocab", vocab["output"], "--output",
                       instances["output"]], config)
    ratios["instances"] = instances["estimate"]["wall_hours"] * 3600 / measured
    print("estimated / measured wall time:", {k: round(v, 2) for k, v in ratios.items()})
    for stage, ratio in ratios.items():  # the right order of magnitude (units, start-up counted), not a speed claim
        assert 0.1 <= ratio <= 10.0, (stage, ratio)

    before = _files(root)
    after = make_plan(cfg)
    assert [s["status"] for s in after["stages"][:4]] == ["cached", "cached", "cached", "will run"]
    assert after["stages"][3]["version"] is not None, "pre-training's version follows from finished instances"
    assert after["data_prep"]["cpu_hours"] == 0
    assert (after["stages"][1]["output"], after["stages"][2]["output"]) == (vocab["output"], instances["output"])

    # the same plan from the command line, as JSON and as `run --dry-run`'s table
    shown = CliRunner().invoke(app, ["plan", "--config", str(config), "--json"])
    assert shown.exit_code == 0, shown.output
    assert [s["status"] for s in json.loads(shown.output)["stages"]][:3] == ["cached"] * 3
    dry = CliRunner().invoke(app, ["run", "--config", str(config), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.count("cached") >= 3 and "measured on" in dry.output
    assert _files(root) == before, "planning wrote under the storage root"


def test_assumed_sizes_stand_for_absent_inputs(samples_dir, make_pipeline_config, tmp_path):
    cfg = make_pipeline_config(samples_dir, tmp_path / "data", "corpus.books=[]",
                               "corpus.wikipedia=[dumps/enwiki-*-pages-articles-multistream.xml.bz2]")
    assumed = "dumps/enwiki-*-pages-articles-multistream.xml.bz2=24GB"
    assert parse_assumed(assumed).size == 24_000_000_000
    one, many = make_plan(cfg, 1, [assumed]), make_plan(cfg, 32, [assumed])
    corpus = one["stages"][0]
    assert corpus["version"] is None and "assumed" in corpus["note"]
    assert one["inputs"][0]["text_bytes"] == 4 * 24_000_000_000  # compressed: counted by its ratio
    assert many["stages"][0]["estimate"]["workers"] == 32
    assert many["data_prep"]["wall_hours"] < one["data_prep"]["wall_hours"] / 16
    pretrain = one["stages"][3]["estimate"]
    assert pretrain["tokens"] > 0 and pretrain["flops"] > 0 and pretrain["gpu"]["gpu_hours"]


def test_the_demo_plan_before_the_samples_are_fetched_counts_them_at_their_size(samples_dir, tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo preset reads samples/..., not fetched here
    before = CliRunner().invoke(app, ["plan", "--preset", "demo"], terminal_width=200)
    assert before.exit_code == 0, before.output
    assert "not here yet: samples/" in before.output and "`make samples`" in before.output
    assert "Estimated at their expected size." in before.output
    assert "GPU" not in before.output, "a CPU run shows no GPU time"
    assert "210 steps" in before.output
    assert not (tmp_path / "bertpipe-data").exists()
    # the sizes it assumed are the sizes the fetch lays out
    (tmp_path / "samples").symlink_to(samples_dir, target_is_directory=True)
    after = CliRunner().invoke(app, ["plan", "--preset", "demo", "--json"])
    assert after.exit_code == 0, after.output
    fetched = {r["pattern"]: r["bytes"] for r in json.loads(after.output)["inputs"]}
    assert not any(r.get("missing") for r in json.loads(after.output)["inputs"])
    (tmp_path / "samples").unlink()
    planned = json.loads(CliRunner().invoke(app, ["plan", "--preset", "demo", "--json"]).output)
    assert {r["pattern"]: r["bytes"] for r in planned["inputs"]} == fetched
    assert all(r["missing"] and r["assumed"] for r in planned["inputs"])


def test_an_input_not_here_is_named_with_what_fetches_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["plan", "--preset", "demo", "--set", "corpus.books=[books/*.txt]",
                                     "--set", "corpus.wikipedia=[dumps/enwiki-*.xml.bz2]",
                                     "--set", "corpus.text=[]", "--set", "pretrain.accelerator=gpu"],
                               terminal_width=200)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert any("dumps/enwiki-*.xml.bz2" in line and "bertpipe download wikipedia" in line for line in lines)
    assert any("books/*.txt" in line and "Counted as 0 MB" in line for line in lines)
    assert "GPU-hours" in shown.output  # a GPU run shows its GPU time
