"""bert_core.model.bert / bert_core.model.checkpoint / `bertpipe export` against transformers on real weights.

The reference is transformers' BERT loaded from the real MiniLM sample (6 layers, H=384,
the bert-base-uncased vocab); batches are real sentences tokenized with its vocab.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bert_core.config import ModelConfig
from bert_core.model.bert import BertForPreTraining, BertModel
from bert_core.model.checkpoint import (
    CheckpointError,
    hf_config_from_model,
    load_pretrained,
    model_config_from_hf,
    save_pretrained,
)
from bert_core.vocab.tokenization import Tokenizer

transformers = pytest.importorskip("transformers")

SENTENCES = [
    ("The cat sat on the mat.", "It was a sunny day in the old town."),
    ("Botchan is a novel by Natsume Soseki.", "It was published in 1906."),
    ("Anarchism is a political philosophy.", "Rain."),
    ("Short one.", "And another, somewhat longer, second sentence about the weather here."),
]


@pytest.fixture(scope="module")
def minilm(samples_dir: Path) -> Path:
    return samples_dir / "models" / "minilm"


def _batch(minilm: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Real sentence pairs -> padded [CLS] A [SEP] B [SEP] batch with ~15% of tokens masked."""
    vocab = {t: i for i, t in enumerate((minilm / "vocab.txt").read_text().splitlines())}
    tok = transformers.BertTokenizerFast(vocab_file=str(minilm / "vocab.txt"), do_lower_case=True)
    rng = torch.Generator().manual_seed(seed)
    seqs, types, positions, labels = [], [], [], []
    for a, b in SENTENCES:
        ia, ib = tok(a, add_special_tokens=False)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
        ids = [vocab["[CLS]"], *ia, vocab["[SEP]"], *ib, vocab["[SEP]"]]
        seqs.append(ids)
        types.append([0] * (len(ia) + 2) + [1] * (len(ib) + 1))
        cand = [i for i, t in enumerate(ids) if t not in (vocab["[CLS]"], vocab["[SEP]"])]
        n = max(1, round(0.15 * len(ids)))
        pick = sorted(cand[j] for j in torch.randperm(len(cand), generator=rng)[:n].tolist())
        positions.append(pick)
        labels.append([ids[p] for p in pick])
    B, T = len(seqs), max(map(len, seqs))
    P = max(map(len, positions))
    out = {k: torch.zeros(B, n, dtype=torch.long) for k, n in
           [("input_ids", T), ("token_type_ids", T), ("attention_mask", T),
            ("masked_lm_positions", P), ("masked_lm_ids", P)]}
    out["masked_lm_weights"] = torch.zeros(B, P)
    for i in range(B):
        masked = list(seqs[i])
        for p in positions[i]:
            masked[p] = vocab["[MASK]"]
        out["input_ids"][i, : len(masked)] = torch.tensor(masked)
        out["token_type_ids"][i, : len(masked)] = torch.tensor(types[i])
        out["attention_mask"][i, : len(masked)] = 1
        out["masked_lm_positions"][i, : len(positions[i])] = torch.tensor(positions[i])
        out["masked_lm_ids"][i, : len(labels[i])] = torch.tensor(labels[i])
        out["masked_lm_weights"][i, : len(labels[i])] = 1
    out["next_sentence_label"] = torch.tensor([0, 0, 1, 1])
    return out


def _hf_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our (positions, ids, weights) -> transformers' [B, T] labels with -100 elsewhere."""
    labels = torch.full_like(batch["input_ids"], -100)
    for i in range(labels.shape[0]):
        real = batch["masked_lm_weights"][i] > 0
        labels[i, batch["masked_lm_positions"][i][real]] = batch["masked_lm_ids"][i][real]
    return labels


def _pretraining_model(minilm: Path, seed: int = 7) -> BertForPreTraining:
    """MiniLM encoder + freshly (seeded) initialised MLM/NSP heads with non-trivial biases."""
    torch.manual_seed(seed)
    model = BertForPreTraining.from_pretrained(str(minilm))
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0, 0.5)
        model.cls.predictions.transform.LayerNorm.weight.normal_(1, 0.1)
    return model


def test_hidden_states_match_transformers_on_minilm(minilm: Path) -> None:
    batch = _batch(minilm)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    ours = BertModel.from_pretrained(str(minilm)).eval()
    ref = transformers.BertModel.from_pretrained(str(minilm)).eval()
    with torch.no_grad():
        a = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], output_hidden_states=True)
        b = ref(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                attention_mask=batch["attention_mask"], output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states) == 7
    real = batch["attention_mask"].bool()
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        assert (x - y)[real].abs().max() < 1e-5
    assert (a.last_hidden_state - b.last_hidden_state)[real].abs().max() < 1e-5
    assert (a.pooler_output - b.pooler_output).abs().max() < 1e-5
    # padding really is masked out: changing a padded token changes no real position
    changed = batch["input_ids"].clone()
    changed[~real] = 1999
    with torch.no_grad():
        c = ours(changed, batch["token_type_ids"], batch["attention_mask"])
    assert (c.last_hidden_state - a.last_hidden_state)[real].abs().max() < 1e-5


def test_pretraining_losses_and_grads_match_transformers(minilm: Path, tmp_path: Path) -> None:
    batch = _batch(minilm)
    ours = _pretraining_model(minilm).eval()  # eval: no dropout, so both sides are deterministic
    save_pretrained(ours, str(tmp_path / "hf"))
    ref = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    labels = _hf_labels(batch)

    out = ours(**batch)
    r = ref(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"], labels=labels,
            next_sentence_label=batch["next_sentence_label"])
    mlm = torch.nn.functional.cross_entropy(r.prediction_logits.flatten(0, 1), labels.flatten())
    nsp = torch.nn.functional.cross_entropy(r.seq_relationship_logits, batch["next_sentence_label"])
    assert abs(out["mlm_loss"].item() - mlm.item()) < 1e-4
    assert abs(out["nsp_loss"].item() - nsp.item()) < 1e-5
    assert abs(out["loss"].item() - r.loss.item()) < 1e-4
    real = labels != -100
    mlm_acc = (r.prediction_logits.argmax(-1)[real] == labels[real]).float().mean()
    nsp_acc = (r.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).float().mean()
    assert out["mlm_acc"].item() == pytest.approx(mlm_acc.item())
    assert out["nsp_acc"].item() == pytest.approx(nsp_acc.item())

    # Same loss, same gradients: training one equals training the other.
    out["loss"].backward()
    r.loss.backward()
    ours_p, ref_p = dict(ours.named_parameters()), dict(ref.named_parameters())
    for name in ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.5.output.dense.weight",
                 "cls.predictions.bias", "cls.seq_relationship.weight", "bert.pooler.dense.bias"]:
        g_ref = ref_p[name].grad
        assert torch.allclose(ours_p[name].grad, g_ref, atol=1e-5, rtol=1e-4), name
    # the stored q/k/v matrix gets transformers' three gradients, stacked
    for kind in ("weight", "bias"):
        attn = "bert.encoder.layer.0.attention.self."
        g_ref = torch.cat([ref_p[f"{attn}{n}.{kind}"].grad for n in ("query", "key", "value")])
        assert torch.allclose(ours_p[f"{attn}qkv.{kind}"].grad, g_ref, atol=1e-5, rtol=1e-4), kind


def test_mlm_loss_only_sees_real_masked_positions(minilm: Path) -> None:
    batch = _batch(minilm)
    model = _pretraining_model(minilm).eval()
    with torch.no_grad():
        base = model(**batch)
        # garbage in the padded prediction slots changes nothing
        noisy = dict(batch)
        pad = batch["masked_lm_weights"] == 0
        assert pad.any()
        noisy["masked_lm_ids"] = batch["masked_lm_ids"].masked_fill(pad, 12345)
        noisy["masked_lm_positions"] = batch["masked_lm_positions"].masked_fill(pad, 3)
        assert torch.equal(model(**noisy)["loss"], base["loss"])
        # NSP label -1 (or None) skips NSP
        no_nsp = model(**{**batch, "next_sentence_label": torch.full((4,), -1)})
        assert no_nsp["nsp_loss"].item() == 0.0 and no_nsp["loss"].item() == pytest.approx(base["mlm_loss"].item())
        assert model(**{**batch, "next_sentence_label": None})["loss"].item() == pytest.approx(base["mlm_loss"].item())


@pytest.mark.parametrize("buckets", [1, 3, 64])
def test_static_shapes_give_the_same_losses_and_gradients(minilm: Path, buckets: int) -> None:
    """token_buckets pads the batch to fixed shapes (the real tokens rounded up to a bucket with
    padding positions, every prediction slot a row labelled IGNORE): same losses, same gradients,
    and shapes that depend only on [B, T], [B, P] and the bucket."""
    from bert_core.model.bert import IGNORE, pretraining_plan

    batch = _batch(minilm)
    B, T = batch["input_ids"].shape
    P = batch["masked_lm_positions"].shape[1]
    keys = ("attention_mask", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights")
    dynamic = pretraining_plan(*(batch[k] for k in keys))
    static = pretraining_plan(*(batch[k] for k in keys), token_buckets=buckets)
    size = -(-B * T // buckets)
    n_real = dynamic["token_index"].numel()
    assert n_real < B * T and static["padded"]
    assert static["token_index"].numel() == min(B * T, -(-n_real // size) * size)
    assert torch.equal(static["token_index"][:n_real], dynamic["token_index"])
    assert static["cu_seqlens"].numel() == B + 1 + -(-size // T)
    assert int(static["cu_seqlens"][-1]) == static["token_index"].numel()
    assert static["output_rows"].numel() == B + B * P and static["mlm_labels"].numel() == B * P
    assert int((static["mlm_labels"] != IGNORE).sum()) == dynamic["mlm_labels"].numel()

    # Dropout off: its masks are drawn over [N, H], so they differ with N (in distribution alike).
    # float64, so the check does not turn on the CPU's summation order over padded rows
    model = _pretraining_model(minilm).double().eval()
    results = []
    for plan in (dynamic, static):
        model.zero_grad(set_to_none=True)
        out = model(**batch, **plan)
        out["loss"].backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc"):
        assert float(a[key].detach()) == pytest.approx(float(b[key].detach()), abs=1e-6), key
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], atol=1e-6, rtol=1e-5), name


def _tiny_pretraining_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Four sequences of 16 slots (16, 12, 9 and 6 real tokens), 5 prediction slots each with 5,
    4, 3 and 2 of them real, one row without an NSP label."""
    g = torch.Generator().manual_seed(seed)
    lengths, predictions = torch.tensor([16, 12, 9, 6]), torch.tensor([5, 4, 3, 2])
    mask = (torch.arange(16) < lengths[:, None]).long()
    return {"input_ids": torch.randint(5, vocab_size, (4, 16), generator=g) * mask,
            "token_type_ids": torch.zeros(4, 16, dtype=torch.long), "attention_mask": mask,
            "masked_lm_positions": torch.stack([torch.randperm(int(n) - 1, generator=g)[:5] + 1 for n in lengths]),
            "masked_lm_ids": torch.randint(5, vocab_size, (4, 5), generator=g),
            "masked_lm_weights": (torch.arange(5) < predictions[:, None]).float(),
            "next_sentence_label": torch.tensor([0, 1, 0, -1])}


def test_chunked_mlm_loss_gives_the_same_loss_and_gradients() -> None:
    """mlm_loss_chunk > 0: the masked-LM loss a chunk of rows at a time, each chunk's logits
    recomputed in the backward pass. The same losses and gradients, with a chunk that does not
    divide the rows and IGNORE rows among them (token_buckets' labels). In float64, so that the
    comparison is of the computation, not of fp32's summation order."""
    from bert_core.model.bert import IGNORE, pretraining_plan

    torch.manual_seed(0)
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=1000, hidden_dropout_prob=0,
                                           attention_probs_dropout_prob=0)).double()
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0, 0.5)
    batch = _tiny_pretraining_batch(1000)
    keys = ("attention_mask", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights")
    plan = pretraining_plan(*(batch[k] for k in keys), token_buckets=2)
    chunk = 6
    assert plan["mlm_labels"].numel() == 20 and (plan["mlm_labels"] == IGNORE).sum() == 6

    results = []
    for model.mlm_loss_chunk in (0, chunk):
        model.zero_grad(set_to_none=True)
        out = model(**batch, **plan)
        out["loss"].backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, grads_full), (chunked, grads_chunked) = results
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc"):
        assert float(chunked[key].detach()) == pytest.approx(float(full[key].detach()), rel=1e-6), key
    assert grads_chunked.keys() == grads_full.keys()
    for name, grad in grads_full.items():
        assert grad.norm() > 0 and (grads_chunked[name] - grad).norm() <= 1e-6 * grad.norm(), name


def test_chunked_mlm_loss_of_a_batch_without_predictions_touches_the_head() -> None:
    """No predictions (every prediction slot padding): loss 0, and the head still gets (zero)
    gradients, as ZeRO expects of every parameter."""
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=64, hidden_dropout_prob=0,
                                           attention_probs_dropout_prob=0))
    model.mlm_loss_chunk = 3
    batch = _tiny_pretraining_batch(64)
    out = model(**{**batch, "masked_lm_weights": torch.zeros(4, 5)})
    out["loss"].backward()
    assert out["mlm_loss"].item() == 0.0 and out["mlm_acc"].item() == 0.0
    assert model.cls.predictions.bias.grad is not None and not model.cls.predictions.bias.grad.any()


def test_export_cli_round_trips_through_transformers(minilm: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flows.cli.main import app

    model = _pretraining_model(minilm).eval()
    save_pretrained(model, str(tmp_path / "ours"), vocab_file=str(minilm / "vocab.txt"))
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ours"), "--output", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"} <= set(files)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]

    ref = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    batch = _batch(minilm, seed=1)
    with torch.no_grad():
        r = ref(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                attention_mask=batch["attention_mask"])
        hidden = model.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        ours_logits = model.mlm_logits(hidden.last_hidden_state)  # all positions, to compare
        ours_nsp = model.cls.seq_relationship(hidden.pooler_output)
    real = batch["attention_mask"].bool()
    assert (ours_logits - r.prediction_logits)[real].abs().max() < 1e-4
    assert (ours_nsp - r.seq_relationship_logits).abs().max() < 1e-5
    # and the tokenizer shipped with it works in transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.tokenize("Hello World") == ["hello", "world"]
    # a folder that is not a checkpoint fails with a message naming it
    res = CliRunner().invoke(app, ["export", str(tmp_path), "--output", str(tmp_path / "x")])
    assert res.exit_code == 1 and str(tmp_path) in res.output


def test_load_with_and_without_bert_prefix_and_from_bin(minilm: Path, tmp_path: Path) -> None:
    batch = _batch(minilm)
    plain = BertModel.from_pretrained(str(minilm)).eval()  # MiniLM keys have no `bert.` prefix
    save_pretrained(_pretraining_model(minilm), str(tmp_path / "prefixed"))
    cfg, state = load_pretrained(str(tmp_path / "prefixed"))
    assert all(k.startswith(("bert.", "cls.")) for k in state)
    prefixed = BertModel.from_pretrained(str(tmp_path / "prefixed")).eval()
    # a pickled pytorch_model.bin with `bert.` keys, read with weights_only=True
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((minilm / "config.json").read_text())
    torch.save({f"bert.{k}": v for k, v in plain.state_dict().items()}, tmp_path / "bin" / "pytorch_model.bin")
    from_bin = BertForPreTraining.from_pretrained(str(tmp_path / "bin")).eval()
    with torch.no_grad():
        args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        a = plain(*args).last_hidden_state
        assert torch.equal(prefixed(*args).last_hidden_state, a)
        assert torch.equal(from_bin.bert(*args).last_hidden_state, a)
    assert model_config_from_hf(hf_config_from_model(cfg)) == cfg

    # a .bin that is not plain tensors is refused, not unpickled
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "config.json").write_text((minilm / "config.json").read_text())
    torch.save({"x": Path("/")}, tmp_path / "evil" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_pretrained(str(tmp_path / "evil"))
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(str(tmp_path / "nowhere"))


def test_pre_layer_norm_runs_differs_and_round_trips(tmp_path: Path) -> None:
    cfg = ModelConfig(size="tiny", vocab_size=300, max_position_embeddings=64)
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    outs = {}
    for pre in (False, True):
        torch.manual_seed(0)
        model = BertForPreTraining(cfg.model_copy(update={"pre_layer_norm": pre})).eval()
        assert (model.bert.encoder.ln is not None) == pre
        with torch.no_grad():
            outs[pre] = model.bert(ids, None, mask).last_hidden_state
        loss = model(ids, None, mask, torch.tensor([[1, 2], [3, 0]]), torch.tensor([[7, 8], [9, 0]]),
                     torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1]))["loss"]
        loss.backward()
        assert torch.isfinite(loss) and model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert torch.isfinite(outs[True]).all()
    assert (outs[True] - outs[False]).abs().max() > 1e-3
    save_pretrained(model, str(tmp_path / "pre"))
    back = BertForPreTraining.from_pretrained(str(tmp_path / "pre")).eval()
    assert back.config.pre_layer_norm
    with torch.no_grad():
        assert torch.equal(back.bert(ids, None, mask).last_hidden_state, outs[True])


def test_output_positions_are_the_rows_of_the_full_output() -> None:
    """The pre-training shortcut (last layer only at the read positions) changes no number."""
    ids = torch.randint(5, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    positions = torch.tensor([1, 5, 15, 16 + 3, 16 + 8, 32 + 2])  # flat b * T + t, real tokens only
    for pre in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(size="tiny", vocab_size=300, max_position_embeddings=64, pre_layer_norm=pre)
        model = BertModel(cfg).eval()
        with torch.no_grad():
            full = model(ids, None, mask)
            part = model(ids, None, mask, output_positions=positions)
        assert part.last_hidden_state.shape == (6, 128)
        assert torch.allclose(part.last_hidden_state, full.last_hidden_state.reshape(-1, 128)[positions], atol=1e-6)
        assert torch.allclose(part.pooler_output, full.pooler_output, atol=1e-6)
    with pytest.raises(ValueError, match=r"\(1, 12\).*padding"):
        model(ids, None, mask, output_positions=torch.tensor([16 + 12]))


DS_SCRIPT = textwrap.dedent("""
    import copy, json, os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertForPreTraining
    torch.manual_seed(0)
    # no dropout: the loops draw from one RNG in a different order
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=300, max_position_embeddings=64,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(5, 300, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    batch = (ids, None, mask, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[7, 8], [9, 10]]),
             torch.ones(2, 2), torch.tensor([0, 1]))
    deepspeed.init_distributed(dist_backend="gloo")
    engines, losses = {}, {}
    for stage in (0, 3):
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
        m = copy.deepcopy(model)
        engines[stage], *_ = deepspeed.initialize(model=m, config=ds, model_parameters=m.parameters())
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    losses = {"zero0": [], "zero3": [], "plain": []}
    for _ in range(3):
        for stage, engine in engines.items():
            out = engine(*batch)
            engine.backward(out["loss"]); engine.step()
            losses[f"zero{stage}"].append(out["loss"].item())
        loss = plain(*batch)["loss"]
        loss.backward(); opt.step(); opt.zero_grad()
        losses["plain"].append(loss.item())
    engines[3].save_checkpoint(sys.argv[1] + "/checkpoints")
    save_pretrained(engines[0].module, sys.argv[1] + "/zero0")
    print(json.dumps(losses))
""")


def test_zero3_trains_like_plain_torch_and_exports(tmp_path: Path, minilm: Path) -> None:
    """Real DeepSpeed engines (one gloo rank, own process): ZeRO-3 gives the losses of ZeRO-0 and of
    a plain PyTorch loop (so the fused q/k/v read of partitioned weights works), and its
    checkpoint exports (zero_to_fp32) to the same trained weights as ZeRO-0's module."""
    import os
    import random

    script = tmp_path / "train.py"
    script.write_text(DS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(random.Random(os.getpid()).randint(29700, 29999))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), port], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.strip().splitlines()[-1])
    # ZeRO-3 (weights partitioned, gathered per module) computes what unpartitioned training does
    assert losses["zero3"] == pytest.approx(losses["zero0"], abs=1e-5)
    # and DeepSpeed what a plain PyTorch loop does (to float rounding, which AdamW then amplifies)
    assert losses["zero0"][0] == pytest.approx(losses["plain"][0], abs=1e-6)
    assert losses["zero0"] == pytest.approx(losses["plain"], rel=1e-2)
    assert losses["zero3"][-1] < losses["zero3"][0] - 0.5
    from typer.testing import CliRunner

    from flows.cli.main import app

    res = CliRunner().invoke(app, ["export", str(tmp_path / "checkpoints"), "--output", str(tmp_path / "hf"),
                                   "--vocab", str(minilm / "vocab.txt"), "--preset", "demo"])
    assert res.exit_code == 0, res.output
    _, exported = load_pretrained(str(tmp_path / "hf"))
    _, plain = load_pretrained(str(tmp_path / "zero0"))
    assert exported.keys() == plain.keys()
    for k in plain:
        assert torch.allclose(exported[k], plain[k], atol=1e-4), k
    ref = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"))
    assert ref.config.num_attention_heads == 2 and ref.config.vocab_size == 300


def test_padded_vocab_exports_and_keeps_the_tokenizer_ids(minilm: Path, tmp_path: Path) -> None:
    """A GPU preset's vocab rows (30522 -> 30528) export to a folder transformers opens; the
    tokenizer shipped with it is the vocab's own (same ids), and ours reads the same weights back."""
    vocab_txt = (minilm / "vocab.txt").read_text().splitlines()
    cfg = ModelConfig(size="custom", hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=128, pad_vocab_to_multiple=64).for_vocab(len(vocab_txt))
    assert (len(vocab_txt), cfg.vocab_size) == (30522, 30528)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).eval()
    save_pretrained(model, str(tmp_path / "hf"), vocab_file=str(minilm / "vocab.txt"))
    ref = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    assert ref.config.vocab_size == 30528
    assert (tmp_path / "hf" / "vocab.txt").read_text().splitlines() == vocab_txt
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours_tok = Tokenizer.from_pretrained_dir(str(minilm))
    text = "The padded rows are no token's id."
    assert tok(text, add_special_tokens=False)["input_ids"] == ours_tok.encode(text) and len(tok) == 30522
    back = BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    batch = tok([a for a, _ in SENTENCES], [b for _, b in SENTENCES], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = back.mlm_logits(back.bert(batch["input_ids"], batch["token_type_ids"],
                                         batch["attention_mask"]).last_hidden_state)
        theirs = ref(**batch).prediction_logits
    assert ours.shape[-1] == theirs.shape[-1] == 30528
    real = batch["attention_mask"].bool()
    assert (ours - theirs)[real].abs().max() < 1e-4
