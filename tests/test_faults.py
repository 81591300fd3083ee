"""The fault battery: bad inputs, damaged stage outputs and wrong settings, each met with one
line that names the file or field and the fix (never a traceback), and records that are
rejected, not lost (kept + rejected = read)."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
import shutil
import string
from pathlib import Path

import pytest
from typer.testing import CliRunner

from beam_jobs.clean_corpus import clean
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.dumps import plan_reads
from flows.cli import app

PROSE = ("The river runs through the old town. It was first mapped in 1820 by a surveyor, who "
         "walked its banks for three years. Today it feeds two lakes and a canal. ")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_line(result, code: int, *needles: str) -> None:
    """The command failed with ``code`` and said so in one line holding every needle."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def book_text(title: str, chapters: int = 12) -> str:
    return f"{title}\n\n" + "\n\n".join(f"Chapter {i}. {PROSE}" for i in range(chapters))


def counts_add_up(manifest: dict, source: str) -> dict:
    c = manifest["counts"][source]
    assert c["kept"] + c["rejected"] == c["read"]
    return c


# --------------------------------------------------------------------------- corpus inputs


def test_corrupt_gzip_book_is_one_reject_and_the_other_books_are_kept(tmp_path) -> None:
    books = tmp_path / "books"
    books.mkdir()
    (books / "good.txt").write_text(book_text("A good book"))
    packed = gzip.compress(book_text("Another book").encode())
    (books / "broken.txt.gz").write_bytes(packed[:20] + b"\x00garbage\xff" * 50 + packed[-8:])
    nul = book_text("With NULs", chapters=60)  # the NUL lies past the head that marks binary files
    (books / "nul.txt").write_text(nul[:9000] + nul[9000:].replace("old town", "old\x00 town", 1))
    out = tmp_path / "corpus"
    clean(CorpusConfig(books=[str(books / "*")], dedup_near=False), str(out), workers=1)
    manifest = storage.read_manifest(str(out))
    c = counts_add_up(manifest, "books")
    assert (c["read"], c["kept"], c["rejected"]) == (3, 2, 1)
    assert c["rejected_by_reason"] == {D.UNREADABLE_FILE: 1}
    rejects = [json.loads(line) for f in out.glob("rejects-*.jsonl") for line in f.read_text().splitlines()]
    assert "broken.txt.gz" in rejects[0]["detail"]
    sentences = [s for uri in storage.shard_uris(str(out)) for d in D.read_documents(uri) for s in d["sentences"]]
    assert sentences and not any("\x00" in s for s in sentences)


def test_utf16_bz2_dump_larger_than_a_split_is_read_not_thrown_away(tmp_path) -> None:
    rng = random.Random(0)  # distinct words: the dump must stay large once compressed

    def prose() -> str:
        return " ".join(" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                                 for _ in range(12)).capitalize() + "." for _ in range(20))

    pages = "".join(
        f"  <page>\n    <title>River {i}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{prose()}</text></revision>\n  </page>\n"
        for i in range(1, 400))
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           + pages + "</mediawiki>\n")
    dump = tmp_path / "utf16.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode("utf-16"), 1))  # level 1: many 100 kB blocks
    assert dump.stat().st_size > 256 << 10
    assert [item.kind for item in plan_reads(str(dump))] == ["whole"]
    out = tmp_path / "corpus"
    clean(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"]) == (399, 399)


def test_single_line_page_is_rejected_not_split_into_many_sentences(tmp_path) -> None:
    giant = "Word. " * 30_000  # one 180k-character paragraph of one-word "sentences"
    pages = "".join(
        f"  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n"
        f"    <revision><id>1</id><text xml:space=\"preserve\">{text}</text></revision>\n  </page>\n"
        for i, (title, text) in enumerate([("Giant", giant), ("River", PROSE * 3)], 1))
    dump = tmp_path / "dump.xml"
    dump.write_text('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n'
                    + pages + "</mediawiki>\n")
    out = tmp_path / "corpus"
    clean(CorpusConfig(wikipedia=[str(dump)]), str(out), workers=1)
    c = counts_add_up(storage.read_manifest(str(out)), "wikipedia")
    assert (c["read"], c["kept"], c["rejected_by_reason"]) == (2, 1, {D.LINE_TOO_LONG: 1})


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("args, needles", [
    (["--set", "pretrain.phases.7.max_steps=1"], ["pretrain.phases", "2 item(s)"]),
    (["--set", "pretrain.phases.x.lr=1"], ["pretrain.phases is a list", "pretrain.phases.0"]),
    (["--set", "workers.foo=1"], ["workers is a single value", "'foo'"]),
    (["--set", "corpus.wikipedia=*.bz2"], ["corpus.wikipedia", "quote it"]),
    (["--set", "nosuch=1"], ["nosuch", "Extra inputs"]),
])
def test_bad_set_is_one_line_naming_the_key(args, needles) -> None:
    assert_one_line(invoke("config", "show", *args), 2, *needles)


def test_bad_config_files_are_one_line_naming_the_file(tmp_path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("pretrain: [1,\n")
    assert_one_line(invoke("config", "show", "--config", str(broken)), 2, "broken.yaml", "not valid YAML", "line")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert_one_line(invoke("config", "show", "--config", str(listed)), 2, "list.yaml", "mapping of sections")


def test_bad_literal_option_is_one_line(tmp_path) -> None:
    result = invoke("corpus", "--books", str(tmp_path / "*.txt"), "--text-format", "foo", "--output", str(tmp_path / "o"))
    assert_one_line(result, 2, "text_format", "'none' or 'google'")


@pytest.mark.parametrize("command", ["corpus", "vocab", "instances"])
def test_misspelled_option_of_a_beam_stage_is_refused(command, tmp_path) -> None:
    result = invoke(command, "--corpus-x", "a", "--output", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "No such option" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- stage boundaries


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    (root / "book.txt").write_text(book_text("A book"))
    clean(CorpusConfig(books=[str(root / "book.txt")]), str(root / "corpus"), workers=1)
    return root / "corpus"


def test_truncated_corpus_shard_is_named_at_the_next_stage_and_by_verify(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = invoke("vocab", "--corpus", str(corpus), "--output", str(tmp_path / "vocab"))
    assert_one_line(result, 1, shard.name, "corpus stage wrote", "re-run")
    checked = invoke("verify", str(corpus))
    assert checked.exit_code == 1 and shard.name in checked.output
    assert invoke("verify", str(small_corpus)).exit_code == 0


def test_bit_flipped_shard_fails_its_checksum(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    shard = next(corpus.glob("docs-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(storage.ManifestError, match="sha256"):
        storage.check_shards(str(corpus))


def test_manifest_cut_in_half_is_one_line(small_corpus, tmp_path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(small_corpus, corpus)
    manifest = corpus / storage.MANIFEST
    manifest.write_text(manifest.read_text()[:200])
    assert_one_line(invoke("stats", str(corpus)), 1, "_MANIFEST.json", "not valid JSON", "re-run")


# --------------------------------------------------------------------------- outputs


def test_unwritable_output_is_one_line_and_leaves_no_temporary_files(small_corpus, tmp_path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(book_text("A book"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    result = invoke("corpus", "--books", str(book), "--output", str(a_file / "corpus"))
    assert_one_line(result, 1, "cannot write to", "a-file", "--output")
    result = invoke("vocab", "--corpus", str(small_corpus), "--output", str(a_file / "vocab"))
    assert_one_line(result, 1, "cannot write to", "a-file")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if not os.access(read_only, os.W_OK):  # root may write anywhere: then only the cases above
            result = invoke("corpus", "--books", str(book), "--output", str(read_only / "corpus"))
            assert_one_line(result, 1, "cannot write to", "read-only")
    finally:
        read_only.chmod(0o755)


def test_truncated_model_weights_name_the_file(samples_dir, tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(samples_dir / "models" / "minilm", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    result = invoke("features", "--checkpoint", str(model), "--input",
                    str(samples_dir / "tasks" / "conll" / "ground_truth.txt"), "--output", str(tmp_path / "f.parquet"))
    assert_one_line(result, 1, "model.safetensors", "damaged", "again")


# ---- pre-training
# Real 2-rank DeepSpeed runs of a tiny model. One finished run (3 steps, a checkpoint at every
# step) is shared; each case damages its own copy.

PRETRAIN_SETS = [
    "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
    "model.num_hidden_layers=1", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
    "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
    "pretrain.phases=[{max_seq_length: 64, max_steps: 3, global_batch_size: 8, micro_batch_size: 4, "
    "learning_rate: 0.003, warmup_steps: 1}]",
    "pretrain.log_every=1", "pretrain.checkpoint_every=1",
]


def pretrain(instances: str | Path, run: Path, *sets: str):
    args = [a for s in [*PRETRAIN_SETS, *sets] for a in ("--set", s)]
    return invoke("pretrain", "--instances", str(instances), "--output", str(run), *args)


def assert_stopped(result, code: int, *needles: str) -> None:
    """The run failed with ``code``; its last line says why, holding every needle; no traceback."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]


class Planted:
    """A pickle that writes a file when unpickled: what a hostile ``.pt`` on a shared mount does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def unfinished_copy(run: Path, to: Path) -> Path:
    """The finished run without its manifest and export: a run to resume."""
    shutil.copytree(run, to)
    (to / storage.MANIFEST).unlink()
    shutil.rmtree(to / "hf")
    return to


@pytest.fixture(scope="module")
def pretrain_instances(tmp_path_factory, samples_dir) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_data import make_instances

    return Path(make_instances(tmp_path_factory.mktemp("pretrain-faults"), samples_dir, num_shards=2, max_docs=20))


@pytest.fixture(scope="module")
def finished_run(pretrain_instances, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    result = pretrain(pretrain_instances, run)
    assert result.exit_code == 0, result.output[-3000:]
    assert (run / "checkpoints" / "phase1" / "latest").read_text() == "step3"
    return run


@pytest.mark.slow
def test_rerun_into_a_finished_run_with_another_config_is_refused(pretrain_instances, finished_run) -> None:
    result = pretrain(pretrain_instances, finished_run, "pretrain.phases.0.learning_rate=0.001")
    assert_one_line(result, 2, str(finished_run), "pretrain.phases", "0.003", "0.001", "new --output")
    same = pretrain(pretrain_instances, finished_run, "pretrain.master_port=29999")  # a port is no change
    assert same.exit_code == 0 and "finished already" in same.output


@pytest.mark.slow
def test_broken_checkpoints_fall_back_and_a_planted_pickle_never_runs(
        pretrain_instances, finished_run, tmp_path) -> None:
    import torch

    run = unfinished_copy(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "phase1"
    (ckpt / "latest").write_text("garbage\x00\x17")
    marker = tmp_path / "code-ran"
    torch.save({"module": Planted(marker)}, ckpt / "step3" / "mp_rank_00_model_states.pt")
    proof = tmp_path / "proof"  # the plant is real: an unguarded load runs it
    torch.save({"module": Planted(proof)}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert proof.exists()
    step2 = ckpt / "step2" / "mp_rank_00_model_states.pt"
    step2.write_bytes(step2.read_bytes()[: step2.stat().st_size // 2])

    result = pretrain(pretrain_instances, run)
    assert result.exit_code == 0, result.output[-3000:]
    assert not marker.exists()  # no code from the run folder ran
    out = result.output
    assert "latest names 'garbage" in out
    assert f"skipped checkpoint {ckpt}/step3: holds pickled objects that are not weights" in out
    assert f"skipped checkpoint {ckpt}/step2: cannot be read" in out
    assert f"resumed at step 1 from {ckpt}/step1" in out and "Traceback" not in out
    assert storage.has_manifest(str(run)) and (ckpt / "latest").read_text() == "step3"
    # the resumed steps log the rate they used, as the uninterrupted run did (not 0.0)
    lr = {r["step"]: r["lr"] for r in read_train_rows(finished_run)}
    again = {r["step"]: r["lr"] for r in read_train_rows(run)}
    assert again == pytest.approx(lr) and again[2] > 0


def read_train_rows(run: Path) -> list[dict]:
    from bert_core.pretrain.metrics import read_metrics, train_rows

    return train_rows(read_metrics(str(run)))


@pytest.mark.slow
def test_no_checkpoint_that_loads_is_one_line(pretrain_instances, finished_run, tmp_path) -> None:
    run = unfinished_copy(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "phase1"
    (ckpt / "latest").write_text("step9")  # names a step that is not there
    for step in (1, 2, 3):
        model = ckpt / f"step{step}" / "mp_rank_00_model_states.pt"
        model.write_bytes(model.read_bytes()[:1000])
    result = pretrain(pretrain_instances, run)
    assert_stopped(result, 2, f"{ckpt}: no checkpoint loads", "step3 cannot be read", "delete it")
    assert "'step9', not a saved step" in result.output


@pytest.mark.slow
def test_full_disk_at_a_checkpoint_fails_once_and_never_becomes_latest(pretrain_instances, tmp_path) -> None:
    run = tmp_path / "run"
    step2 = run / "checkpoints" / "phase1" / "step2"
    step2.mkdir(parents=True)
    (step2 / "mp_rank_00_model_states.pt").symlink_to("/dev/full")  # this file's disk is full
    result = pretrain(pretrain_instances, run)
    assert_stopped(result, 2, f"{step2}: cannot write the checkpoint", "free space")
    assert "run the same command again" not in result.output  # not an infrastructure retry
    assert (run / "checkpoints" / "phase1" / "latest").read_text() == "step1"


@pytest.mark.slow
def test_truncated_instance_shard_is_a_data_error_not_a_retry(pretrain_instances, tmp_path) -> None:
    instances = tmp_path / "instances"
    shutil.copytree(pretrain_instances, instances)
    shard = sorted((instances / "seq64").glob("*.parquet"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = pretrain(instances, tmp_path / "run")
    assert_stopped(result, 2, shard.name)
    assert "run the same command again" not in result.output
