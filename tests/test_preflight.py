"""The preflight of ``bertpipe run`` and ``bertpipe refresh``: every missing input in one line
before any work, and a flow that fails inside a stage ends the command with its one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bert_core import storage
from bert_core.config import load_config
from bert_core.preflight import PreflightConfigError, PreflightError, check_refresh, check_run
from bert_core.refresh.registry import Registry, registry_root

BERTPIPE = str(Path(sys.executable).with_name("bertpipe"))


def _config(samples: Path, root: Path, *sets: str):
    """The demo preset on one book, one fine-tune task on the samples and MiniLM as the extra checkpoint."""
    return load_config("demo", sets=[
        f"storage_root={root}", "corpus.wikipedia=[]", "corpus.text=[]",
        f"corpus.books=[{samples}/books/botchan.txt]",
        "finetune.tasks=[sentiment]", f"finetune.data_dir={samples}/tasks",
        f"finetune.extra_checkpoints=[{samples}/models/minilm]", *sets])


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)  # Prefect's own temporary server, as a new user has it
    return subprocess.run([BERTPIPE, *args], capture_output=True, text=True, env=env, timeout=600)


def test_the_preflight_lists_every_missing_input_at_once(samples_dir, tmp_path):
    root = tmp_path / "data"
    check_run(_config(samples_dir, root))  # the samples have every input

    tasks = tmp_path / "tasks"
    (tasks / "MRPC").mkdir(parents=True)
    (tasks / "MRPC" / "train.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
    shutil.copytree(samples_dir / "tasks" / "ner", tasks / "ner")
    cfg = _config(samples_dir, root, f"corpus.text=[{tmp_path}/gone/*.jsonl]",
                  f"vocab.vocab_file={tmp_path}/vocab.txt",
                  "finetune.tasks=[sentiment, mrpc, ner, squad]", f"finetune.data_dir={tasks}",
                  f"finetune.extra_checkpoints=[{samples_dir}/models/minilm, {tmp_path}/gone-model, models:current]")
    with pytest.raises(PreflightError) as caught:
        check_run(cfg)
    err = caught.value
    assert not isinstance(err, PreflightConfigError)  # task files are data: exit 1
    named = [f"{tmp_path}/gone/*.jsonl", f"{tmp_path}/vocab.txt", f"{tasks}/sentiment", f"{tasks}/MRPC/dev.tsv",
             f"{tasks}/squad", f"{tmp_path}/gone-model", "models:current"]
    assert len(err.problems) == len(named)
    for problem, name in zip(err.problems, named, strict=True):
        assert name in problem
    assert "\n" not in str(err) and str(err).startswith("nothing was run, 7 input problems: (1) ")
    assert not root.exists()

    # problems of the config alone are a config error (exit 2)
    with pytest.raises(PreflightConfigError, match=r"1 input problem: finetune.data_dir is not set"):
        check_run(_config(samples_dir, root, "finetune.data_dir=null"))
    with pytest.raises(PreflightConfigError, match=r"1 input problem: no corpus inputs: set corpus.wikipedia"):
        check_run(_config(samples_dir, root, "corpus.books=[]"))
    records = tmp_path / "records.jsonl"
    records.write_text('{"body": "a sentence. and another."}\n')
    with pytest.raises(PreflightConfigError, match=r"records.jsonl: no record has the field 'text' \(they have: body\)"):
        check_run(_config(samples_dir, root, f"corpus.text=[{records}]"))
    # two extra checkpoints of one folder name would share finetune/<name>
    (tmp_path / "other" / "minilm").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "other" / "minilm" / name).symlink_to(samples_dir / "models" / "minilm" / name)
    with pytest.raises(PreflightConfigError, match="would share the folder finetune/minilm"):
        check_run(_config(samples_dir, root, "finetune.extra_checkpoints="
                          f"[{samples_dir}/models/minilm, {tmp_path}/other/minilm]"))


def test_every_task_s_files_are_found_as_its_reader_finds_them(samples_dir):
    from bert_core.finetune import TASKS, task_files

    fixtures = Path(__file__).parent / "fixtures" / "tasks"
    for name in sorted(TASKS.keys() - {"sentiment"}):
        found = task_files(str(fixtures), name)
        assert found and all(Path(f).is_file() for f in found), name
    assert task_files(str(samples_dir / "tasks"), "sentiment@300") == [
        str(f) for f in sorted((samples_dir / "tasks" / "sentiment").glob("*.txt"))]
    assert task_files(str(fixtures), "mnli") == [str(fixtures / "MNLI" / f"{s}.tsv")
                                                 for s in ("train", "dev_matched", "dev_mismatched")]


def _whole(folder: Path, stage: str) -> str:
    files = [str(f) for f in sorted(folder.iterdir())]
    storage.write_manifest(str(folder), stage=stage, config={}, shards=[storage.shard_entry(f) for f in files])
    return str(folder)


def test_the_refresh_preflight_checks_the_current_model_and_its_vocab(samples_dir, tmp_path):
    root = tmp_path / "data"
    cfg = _config(samples_dir, root, f"finetune.data_dir={tmp_path}/no-tasks")
    minilm = samples_dir / "models" / "minilm"
    vocab, model = tmp_path / "vocab", root / "models" / "v1"
    vocab.mkdir()
    (vocab / "vocab.txt").write_text("\n".join(f"token{i}" for i in range(40)) + "\n")
    model.mkdir(parents=True)
    hf = json.loads((minilm / "config.json").read_text()) | {"vocab_size": 32}
    (model / "config.json").write_text(json.dumps(hf))
    shutil.copy(minilm / "vocab.txt", model / "vocab.txt")
    registry = Registry(registry_root(str(root)))
    registry.register({"version": "v1", "model": _whole(model, "model"), "vocab": _whole(vocab, "vocab")})
    registry.promote("v1")

    with pytest.raises(PreflightError) as caught:
        check_refresh(cfg, date="2026-12")
    problems = caught.value.problems
    assert len(problems) == 4
    assert problems[0].startswith("--date '2026-12': give a dump date as YYYYMMDD")
    assert "vocab_size=32 but the instances' vocab has 40 tokens" in problems[1]
    assert problems[2].startswith(f"{root}/models/v1/vocab.txt (30522 tokens) is not the vocab the instances "
                                  "were made with")
    assert f"{tmp_path}/no-tasks/sentiment does not exist" in problems[3]

    # a current model whose folder is gone stops the refresh before its download
    (model / storage.MANIFEST).unlink()
    with pytest.raises(PreflightError, match=r"models:current is v1, whose folder .* is not whole"):
        check_refresh(cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"tasks": []})}))


def test_bertpipe_run_with_a_missing_task_file_stops_in_its_first_seconds(samples_dir, tmp_path):
    root = tmp_path / "data"
    (tmp_path / "tasks" / "ner").mkdir(parents=True)
    (tmp_path / "tasks" / "ner" / "train.txt").write_text("EU B-ORG\n")
    done = _cli(tmp_path, "run", "--set", f"storage_root={root}", "--set", "corpus.wikipedia=[]",
                "--set", "corpus.text=[]", "--set", f"corpus.books=[{samples_dir}/books/botchan.txt]",
                "--set", "finetune.tasks=[ner]", "--set", f"finetune.data_dir={tmp_path}/tasks",
                "--set", "finetune.extra_checkpoints=[]")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()  # no Prefect server was started, no traceback
    assert line.startswith("nothing was run, 1 input problem: ")
    assert f"{tmp_path}/tasks/ner: no valid file (valid.txt or eng.testa or dev.txt)" in line
    assert not root.exists()


@pytest.mark.slow
def test_a_flow_that_fails_in_a_stage_ends_with_its_one_line(samples_dir, tmp_path):
    # Records that pass the preflight (a file, with the text field) but each too short to keep: the
    # corpus stage keeps no document, and the pipeline stops in its first stages.
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"text": f"hi {i}"}) + "\n" for i in range(3)))
    done = _cli(tmp_path, "run", "--set", f"storage_root={tmp_path}/data", "--set", "corpus.wikipedia=[]",
                "--set", "corpus.books=[]", "--set", f"corpus.text=[{records}]",
                "--set", "finetune.tasks=[sentiment]", "--set", f"finetune.data_dir={samples_dir}/tasks",
                "--set", "finetune.extra_checkpoints=[]")
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "Stopping temporary server" in lines[-2]
    # the last line is the error the failed run ended with, as the run's final state says it
    assert not re.match(r"\d\d:\d\d:\d\d", lines[-1])  # not a log line
    assert any(lines[-1] in ln for ln in lines if "Finished in state Failed(" in ln)
    # the traceback is in the run's log on the server (its database under PREFECT_HOME)
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        logged = [m for (m,) in db.execute("SELECT message FROM log WHERE message LIKE '%Traceback%'")]
    assert any(lines[-1] in m for m in logged)


def test_missing_task_data_names_the_command_that_fetches_it(tmp_path):
    """The bert-base preset on a fresh machine: each GLUE task's refusal says `bertpipe tasks fetch`,
    CoNLL-2003 says where its files go; files in place pass."""
    from bert_core.preflight import task_data

    root = tmp_path / "data"
    cfg = load_config("bert-base-128", sets=[f"storage_root={root}", "finetune.tasks=[mrpc, ner, sentiment]"])
    assert cfg.finetune.data_dir == f"{root}/tasks"
    with pytest.raises(PreflightError) as caught:
        check_run(cfg)
    wiki, *_ = caught.value.problems
    assert f"{root}/downloads/wikipedia/*/enwiki-" in wiki and "`bertpipe download wikipedia --date" in wiki
    problems = [p for p in caught.value.problems if "for task" in p or "sentiment" in p]
    assert problems[0].startswith(f"no data for task 'mrpc' under {root}/tasks: run 'bertpipe tasks fetch mrpc' (")
    assert f"put the CoNLL-2003 files in {root}/tasks/ner/{{train,valid,test}}.txt" in problems[1]
    assert "tasks fetch" not in problems[2]  # sentiment comes with the samples, not from tasks fetch
    # another data_dir: the command says where to put it
    other = load_config("bert-base-128", sets=[f"storage_root={root}", f"finetune.data_dir={tmp_path}/glue"])
    with pytest.raises(Exception, match=f"run 'bertpipe tasks fetch mrpc --to {tmp_path}/glue'"):
        task_data(other, "mrpc")
    shutil.copytree(Path(__file__).parent / "fixtures" / "tasks" / "MRPC", root / "tasks" / "MRPC")
    assert task_data(cfg, "mrpc") == [f"{root}/tasks/MRPC/train.tsv", f"{root}/tasks/MRPC/dev.tsv"]
