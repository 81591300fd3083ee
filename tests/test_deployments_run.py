"""Every deployment of infra/prefect.yaml starts as rendered: a Quick Run from the UI gives a flow
only the deployment's parameters, so every parameter a flow requires is rendered, and each stage
flow finds its inputs and names its output from the config alone (``flows.versions.stage_paths``)."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest

from bert_core import storage
from bert_core.config import PipelineConfig, apply_set, load_config
from flows.tools.deployments import deployment_specs
from flows.versions import stage_paths

REPO = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO / "infra" / "prefect.yaml"
# The stage flows in the order they run; each reads the folders of the ones before it.
STAGES = {"flows/corpus.py:clean_corpus": "corpus", "flows/vocab.py:build_vocab": "vocab",
          "flows/instances.py:create_instances": "instances", "flows/pretrain.py:pretrain": "pretrain"}
# The demo preset cut to seconds, set on the rendered config as a user edits a deployment's
# parameters: one book of the samples (under the rendered relative paths), a small vocab, a few
# steps a phase.
TINY = [
    "corpus.wikipedia=[]", "corpus.text=[]", "corpus.books=[samples/books/botchan.txt]",
    "vocab.vocab_size=1000", "instances.dupe_factor=1", "instances.num_shards=2",
    "pretrain.phases=[{max_seq_length: 64, max_steps: 2, global_batch_size: 8, micro_batch_size: 4, "
    "warmup_steps: 1}, {max_seq_length: 512, max_steps: 1, global_batch_size: 4, micro_batch_size: 2, "
    "warmup_steps: 1}]",
    "pretrain.log_every=1", "pretrain.checkpoint_every=2", "pretrain.eval_every=2",
]


def test_every_parameter_a_deployment_s_flow_requires_is_rendered():
    specs = deployment_specs(PREFECT_YAML)
    assert {s["entrypoint"] for s in specs} >= set(STAGES)
    for spec in specs:
        params = inspect.signature(spec["flow"].fn).parameters
        required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
        assert required <= set(spec["parameters"]), (spec["full_name"], required - set(spec["parameters"]))


def test_a_stage_whose_inputs_have_not_run_names_the_stage_to_run_first(tmp_path):
    cfg = load_config("demo", sets=[f"storage_root={tmp_path}"])
    assert stage_paths(cfg, "corpus")["output"].startswith(str(tmp_path / "corpus") + "/")
    for stage, first in (("vocab", "corpus"), ("instances", "corpus"), ("pretrain", "corpus")):
        with pytest.raises(storage.UnfinishedWriteError, match=f"run the {first} stage first"):
            stage_paths(cfg, stage)
    with pytest.raises(ValueError, match="unknown stage"):
        stage_paths(cfg, "finetune")


@pytest.mark.slow
def test_each_stage_deployment_runs_with_only_its_rendered_parameters(prefect_api, samples_dir, tmp_path,
                                                                      monkeypatch):
    specs = sorted((s for s in deployment_specs(PREFECT_YAML) if s["entrypoint"] in STAGES),
                   key=lambda s: list(STAGES).index(s["entrypoint"]))
    monkeypatch.chdir(tmp_path)  # the rendered paths are relative: samples/ and ./bertpipe-data
    (tmp_path / "samples").symlink_to(samples_dir, target_is_directory=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [STAGES[s["entrypoint"]] for s in specs] == ["corpus", "vocab", "instances", "pretrain", "pretrain"]

    outputs = {}
    for spec in specs:
        stage = STAGES[spec["entrypoint"]]
        params = copy.deepcopy(spec["parameters"])
        assert set(params) == {"config"}, spec["full_name"]
        for assignment in TINY:
            params["config"] = apply_set(params["config"], assignment)
        output = spec["flow"](**params)
        # Its inputs were the folders of the stages before it; its output is where the pipeline
        # puts this stage for this config.
        cfg = PipelineConfig.model_validate(params["config"])
        expected = stage_paths(cfg, stage, **{k: v for k, v in outputs.items()
                                              if k in ("corpus", "vocab", "instances")})
        assert output == expected["output"], spec["full_name"]
        assert storage.has_manifest(output), f"{spec['full_name']} wrote no manifest into {output}"
        assert storage.read_manifest(output)["stage"] == stage
        assert Path(output).resolve().is_relative_to(tmp_path / "bertpipe-data" / stage)
        outputs.setdefault(stage, output)
