"""Held-out evaluation during pre-training: rank shares, float64 sums, eval rows, 1 vs 2 ranks.

    .venv/bin/python -m pytest -q tests/test_pretrain_eval.py        # the slow one ~1 min
    .venv/bin/python -m pytest -q tests/test_pretrain_eval.py -m "not slow"

The eval split is written here in the instances contract (``seq{L}/eval/`` shards + manifest) from
later chapters of the real Botchan text than the training shards (see tests/test_data.py), and
evaluated with a real tiny ``BertForPreTraining``; the slow test runs real DeepSpeed launches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bert_core import storage
from bert_core.config import InstanceConfig, SequenceSpec, load_config
from bert_core.instances.batch import create_instance_batch, write_instance_shards
from bert_core.instances.pairs import DocumentPool
from bert_core.pretrain.data import PretrainingLoader, vocab_ids
from bert_core.pretrain.evaluate import (
    EvalSplit,
    eval_folder,
    eval_metrics,
    eval_sums,
    evaluate,
    rank_batches,
)
from bert_core.pretrain.metrics import MetricsLog, MetricsTail, eval_rows, read_metrics, train_rows

sys.path.insert(0, str(Path(__file__).parent))
from test_data import book_documents, make_instances  # noqa: E402
from test_pretrain import comm_op, free_port, tiny_sets  # noqa: E402, F401 (comm_op is a fixture)

SEQ = 64


def add_eval_split(instances: str, samples_dir: Path, num_shards: int = 2, masking: str = "static",
                   first_doc: int = 40, docs: int = 12) -> str:
    """Write ``<instances>/seq64/eval/`` from documents the training shards do not use."""
    vocab_file = str(Path(instances).parent / "vocab" / "vocab.txt")
    vocab = vocab_ids(Path(vocab_file).read_text().splitlines())
    cfg = InstanceConfig(lengths=[SequenceSpec(max_seq_length=SEQ, max_predictions_per_seq=10)],
                         masking=masking, dupe_factor=1, num_shards=num_shards)
    held_out = book_documents(samples_dir, vocab_file, first_doc + docs)[first_doc:]
    batch = create_instance_batch(
        DocumentPool.from_documents(held_out), [f"book:{first_doc + i}" for i in range(len(held_out))],
        seed=cfg.seed, dupe_factor=1, max_seq_length=SEQ, max_predictions_per_seq=10,
        masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob, vocab=vocab,
        mask=masking == "static",
    )
    folder = eval_folder(instances, SEQ)
    shards = write_instance_shards(batch, folder, num_shards)
    storage.write_manifest(folder, stage="instances", config=cfg, shards=shards, counts={"instances": len(batch)})
    return folder


@pytest.fixture(scope="module")
def instances(tmp_path_factory, samples_dir) -> str:
    out = make_instances(tmp_path_factory.mktemp("eval"), samples_dir, num_shards=4, max_docs=40)
    add_eval_split(out, samples_dir)
    return out


def tiny_model():
    from bert_core.model.bert import BertForPreTraining

    cfg = load_config("demo", None, ["model.hidden_size=64", "model.num_attention_heads=2",
                                     "model.intermediate_size=128", "model.num_hidden_layers=1"]).model
    torch.manual_seed(0)
    return BertForPreTraining(cfg.model_copy(update={"vocab_size": 30522}))


# --------------------------------------------------------------------------- shares and sums


@pytest.mark.parametrize("num_rows", [1, 7, 8, 50])
def test_rank_batches_cover_every_row_once_in_the_same_batches_for_any_world_size(num_rows):
    one = rank_batches(num_rows, 4, 0, 1)
    assert [r for b in one for r in b] == list(range(num_rows))
    for world_size in (2, 3):
        shares = [rank_batches(num_rows, 4, r, world_size) for r in range(world_size)]
        assert sorted((b for share in shares for b in share), key=lambda b: b.start) == one


def test_two_rank_shares_sum_to_the_one_rank_numbers_and_touch_no_rng(instances):
    model = tiny_model()
    model.train()
    whole = EvalSplit.open(instances, SEQ, 4)
    assert whole.num_rows == sum(len(t) for t in whole.batches) > 8
    rng = torch.get_rng_state()
    one = eval_sums(model, whole)
    assert torch.equal(torch.get_rng_state(), rng) and model.training  # dropout RNG and mode untouched
    shares = [EvalSplit.open(instances, SEQ, 4, rank=r, world_size=2) for r in (0, 1)]
    assert sum(len(s.batches) for s in shares) == len(whole.batches)
    two = eval_sums(model, shares[0]) + eval_sums(model, shares[1])
    assert two[[1, 2, 4, 5, 6]].tolist() == one[[1, 2, 4, 5, 6]].tolist()  # counts: exactly
    assert two.tolist() == pytest.approx(one.tolist(), rel=1e-9)
    metrics = eval_metrics(one)
    assert metrics["instances"] == whole.num_rows and metrics["predictions"] > whole.num_rows
    assert metrics["loss"] == pytest.approx(metrics["mlm_loss"] + metrics["nsp_loss"])
    assert 9 < metrics["mlm_loss"] < 12  # an untrained model over 30522 tokens: about ln(30522)
    assert 0 <= metrics["mlm_acc"] <= 1 and 0 <= metrics["nsp_acc"] <= 1
    # evaluate() without a process group gives the same numbers
    assert evaluate(model, whole)["mlm_loss"] == pytest.approx(metrics["mlm_loss"], rel=1e-12)


def test_lockstep_ranks_make_the_same_number_of_passes_and_count_each_row_once(instances):
    model = tiny_model()
    shares = [EvalSplit.open(instances, SEQ, 4, rank=r, world_size=3, lockstep=True) for r in range(3)]
    assert len({s.steps for s in shares}) == 1
    assert any(s.filler is not None for s in shares)  # the batch count is not a multiple of 3
    total = sum(eval_sums(model, s) for s in shares)
    assert total[6].item() == shares[0].num_rows
    assert total.tolist() == pytest.approx(eval_sums(model, EvalSplit.open(instances, SEQ, 4)).tolist(), rel=1e-9)


def test_training_loader_state_does_not_change_during_evaluation(instances):
    loader = PretrainingLoader(instances, SEQ, 4, seed=1)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    evaluate(tiny_model(), EvalSplit.open(instances, SEQ, 4))
    assert loader.state_dict() == state
    assert loader.position == 1


def test_instances_without_an_eval_folder_have_no_eval_split(tmp_path, samples_dir):
    bare = make_instances(tmp_path, samples_dir, num_shards=2, max_docs=10)
    assert EvalSplit.open(bare, SEQ, 4) is None


def test_dynamic_masking_masks_the_eval_split_the_same_way_every_time(tmp_path, samples_dir):
    dynamic = make_instances(tmp_path, samples_dir, num_shards=2, masking="dynamic", max_docs=10)
    add_eval_split(dynamic, samples_dir, masking="dynamic", docs=6)
    first, again = (EvalSplit.open(dynamic, SEQ, 4, seed=3) for _ in range(2))
    for a, b in zip(first.batches, again.batches, strict=True):
        assert a.equals(b)
        positions = a.column("masked_lm_positions").to_pylist()
        assert all(len(p) > 0 for p in positions)  # every stored (unmasked) row got predictions
        ids = a.column("input_ids").to_pylist()
        assert any(103 in row for row in ids)  # [MASK] in the inputs
    other_seed = EvalSplit.open(dynamic, SEQ, 4, seed=4)
    assert not all(a.equals(b) for a, b in zip(first.batches, other_seed.batches, strict=True))


# --------------------------------------------------------------------------- metrics rows


def test_eval_rows_follow_train_rows_of_the_same_step_in_log_and_tail(tmp_path):
    run = str(tmp_path / "run")
    log, tail = MetricsLog(run), MetricsTail(run)
    log.append({"phase": 1, "step": 1, "loss": 9.0})  # an old row without a kind is a train row
    log.append({"kind": "train", "phase": 1, "step": 2, "loss": 8.0})
    log.append({"kind": "eval", "phase": 1, "step": 2, "loss": 8.5})
    assert [(r["step"], r.get("kind")) for r in tail.poll()] == [(1, None), (2, "train"), (2, "eval")]
    log.append({"kind": "train", "phase": 1, "step": 3, "loss": 7.0})
    rows = tail.poll()
    assert [r["loss"] for r in train_rows(rows)] == [9.0, 8.0, 7.0]
    assert [r["loss"] for r in eval_rows(rows)] == [8.5]
    resumed = MetricsLog(run)  # a resume from the checkpoint at step 2 keeps that step's eval row
    resumed.truncate(1, 2)
    assert [(r["step"], r.get("kind")) for r in read_metrics(run)] == [(1, None), (2, "train"), (2, "eval")]


def test_pretrain_curves_draw_train_and_eval_on_one_plot():
    import matplotlib.pyplot as plt

    from flows.report import pretrain_curves

    rows = [{"phase": 1, "step": s, "loss": 9.0 - s, "mlm_acc": 0.1 * s, "nsp_acc": 0.5} for s in (1, 2, 3)]
    rows += [{"kind": "eval", "phase": 1, "step": 3, "loss": 6.5, "mlm_acc": 0.25, "nsp_acc": 0.55}]
    figs = pretrain_curves(rows)
    labels = {name: [line.get_label() for line in fig.axes[0].get_lines()] for name, fig in figs.items()}
    assert labels == {"loss": ["train loss phase 1", "eval loss phase 1"],
                      "accuracy": ["train mlm_acc phase 1", "train nsp_acc phase 1",
                                   "eval mlm_acc phase 1", "eval nsp_acc phase 1"]}
    for fig in figs.values():
        plt.close(fig)
    # masked LM only (packed segments, no next-sentence pairs): no NSP curve, no NSP in the titles
    figs = pretrain_curves(rows, nsp=False)
    labels = {name: [line.get_label() for line in fig.axes[0].get_lines()] for name, fig in figs.items()}
    assert labels["accuracy"] == ["train mlm_acc phase 1", "eval mlm_acc phase 1"]
    titles = [fig.axes[0].get_title() for fig in figs.values()]
    assert titles == ["Pre-training loss (MLM), train and eval", "Masked LM accuracy, train and eval"]
    for fig in figs.values():
        plt.close(fig)


# --------------------------------------------------------------------------- real runs (slow)


@pytest.mark.slow
@pytest.mark.usefixtures("comm_op")
def test_eval_rows_during_a_2_rank_run_match_a_1_rank_evaluation_of_the_same_weights(instances, tmp_path):
    """A 2-rank run evaluates every 2 steps and at each phase's end; a 1-rank run that starts
    from its export and makes one update at learning rate 0 (the first warmup step) evaluates
    the same weights: the same numbers up to float summation order."""
    from bert_core.pretrain.launch import launch_pretraining

    lines: list[str] = []
    two = load_config("demo", None, [*tiny_sets(5), "pretrain.eval_every=2", "pretrain.monitor=csv"])
    run = str(tmp_path / "two")
    launch_pretraining(two, instances, run, on_line=lines.append)
    rows = read_metrics(run)
    evals = eval_rows(rows)
    assert [(r["phase"], r["step"]) for r in evals] == [(1, 2), (1, 4), (1, 5), (2, 2), (2, 4)]
    for e in evals:  # each eval row follows the train row of its step
        assert rows[rows.index(e) - 1] | {"kind": "train"} == rows[rows.index(e) - 1]
        assert rows[rows.index(e) - 1]["step"] == e["step"]
    held_out = EvalSplit.open(instances, SEQ, 4).num_rows
    assert all(e["instances"] == held_out for e in evals)
    assert evals[2]["mlm_loss"] < evals[0]["mlm_loss"]  # training lowers the held-out loss
    assert any("eval loss" in line for line in lines)
    manifest = storage.read_manifest(run)
    final = manifest["stats"]["phases"][1]["eval"]
    assert final["loss"] == evals[-1]["loss"] and manifest["stats"]["eval"] == final
    assert manifest["stats"]["phases"][0]["eval"]["step"] == 5
    assert list(Path(run, "monitor").rglob("*Eval*mlm_acc*"))  # DeepSpeed's CSV monitor got the evals

    one = load_config("demo", None, [
        *tiny_sets(5), "pretrain.procs_per_node=1", f"pretrain.master_port={free_port()}",
        f"pretrain.phases=[{{max_seq_length: {SEQ}, max_steps: 1, global_batch_size: 8, "
        "micro_batch_size: 4, learning_rate: 0.001, warmup_steps: 1}]"])
    again = str(tmp_path / "one")
    launch_pretraining(one, instances, again, init_checkpoint=manifest["hf"], on_line=lines.append)
    [check] = eval_rows(read_metrics(again))
    for key in ("instances", "predictions"):
        assert check[key] == evals[-1][key]
    for key in ("loss", "mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc"):
        assert check[key] == pytest.approx(evals[-1][key], rel=1e-5, abs=1e-7), key


def test_masked_lm_accuracy_of_plain_sequences_masks_alike_for_every_model():
    """Fixed masks from the seed: the same counts twice, a model that always predicts the inner
    piece scores 1, [CLS] and [SEP] are never masked, and a sequence without inner pieces is skipped."""
    from bert_core.config import ModelConfig
    from bert_core.pretrain.evaluate import masked_lm_accuracy
    from bert_core.pretrain.in_process import random_init

    sequences = [[2, *range(10, 10 + n), 3] for n in (0, 1, 7, 20)]
    model = random_init(ModelConfig(size="tiny", vocab_size=40), seed=1).train()
    first = masked_lm_accuracy(model, sequences, mask_id=4, seed=0)
    assert first == masked_lm_accuracy(model, sequences, mask_id=4, seed=0) and model.training
    assert first["predictions"] == 1 + 1 + 3 and 0 <= first["mlm_acc"] <= 1

    class Knows7(torch.nn.Module):  # predicts piece 7 wherever it is asked
        def bert(self, ids):
            assert ids[0, 0] == 2 and ids[0, -1] == 3 and (ids == 4).sum() == max(1, round(0.15 * (ids.shape[1] - 2)))
            return type("Out", (), {"last_hidden_state": torch.zeros(*ids.shape, 1)})()

        def mlm_logits(self, hidden):
            return torch.nn.functional.one_hot(torch.full((len(hidden),), 7), 40).float()

    assert masked_lm_accuracy(Knows7(), [[2, 7, 7, 7, 3]] * 3, mask_id=4) == {
        "mlm_acc": 1.0, "mlm_correct": 3, "predictions": 3}
