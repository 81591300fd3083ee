"""An export opens in transformers as the model it is: a pre-LN one (its own model type, the
modeling code written beside the weights) with ``trust_remote_code=True`` and never without, a
post-LN one as transformers' own ``BertModel``. Both compute what bert_core computes.

The pre-LN folder is loaded in a fresh interpreter where ``bert_core`` cannot be imported (the
code an export carries must run where bertpipe is not installed), with ``HF_MODULES_CACHE`` in a
temporary folder (transformers copies remote code there).

    .venv/bin/python -m pytest -q tests/test_export_transformers.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bert_core.config import ModelConfig
from bert_core.model.bert import BertForPreTraining, BertModel
from bert_core.model.checkpoint import (
    PRELN_CODE_FILES,
    PRELN_MODEL_TYPE,
    load_pretrained,
    model_config_from_hf,
    save_pretrained,
)
from bert_core.model.export import export_checkpoint

transformers = pytest.importorskip("transformers")

WORDS = ("the a cat dog sat ran on in mat park old town it was sunny day rain and another "
         "short one longer second sentence about weather here . ,").split()
PAIRS = [
    ("The cat sat on the mat.", "It was a sunny day in the old town."),
    ("Short one.", "Rain."),
    ("The dog ran in the park.", "And another, longer second sentence about the weather here."),
]


def _export(tmp: Path, pre_layer_norm: bool) -> tuple[BertForPreTraining, Path]:
    """A tiny random BERT (fixed seed), saved by bert_core and exported with `bertpipe export`'s code."""
    vocab = tmp / "vocab" / "vocab.txt"
    vocab.parent.mkdir(parents=True, exist_ok=True)
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    cfg = ModelConfig(size="custom", vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=40,
                      pre_layer_norm=pre_layer_norm)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).eval()
    save_pretrained(model, str(tmp / "ours"), vocab_file=str(vocab))
    export_checkpoint(str(tmp / "ours"), str(tmp / "hf"))
    return model, tmp / "hf"


def _batch(folder: Path) -> dict[str, torch.Tensor]:
    """Sentence pairs through the exported tokenizer, padded to the longest. (transformers 5's
    AutoTokenizer reads config.json first, and would ask before running a pre-LN export's code.)"""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    batch = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any() and (batch["token_type_ids"] == 1).any()
    assert tok.unk_token_id not in batch["input_ids"][batch["attention_mask"].bool()].tolist()
    return dict(batch)


# The transformers side, run where `import bert_core` fails.
LOAD_WITH_REMOTE_CODE = textwrap.dedent("""
    import sys
    sys.modules["bert_core"] = None  # the export's code must not need bertpipe
    import torch
    import transformers

    folder, batch_file, out_file, resaved = sys.argv[1:5]
    batch = torch.load(batch_file)
    args = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"])
    out = {}
    kinds = {"base": transformers.AutoModel, "pretraining": transformers.AutoModelForPreTraining,
             "mlm": transformers.AutoModelForMaskedLM}
    with torch.no_grad():
        for name, auto in kinds.items():
            model = auto.from_pretrained(folder, trust_remote_code=True).eval()
            out[name + ".class"] = type(model).__name__
            r = model(**args, output_hidden_states=True)
            if name == "base":
                out["hidden_states"] = list(r.hidden_states)
                out["last_hidden_state"], out["pooler_output"] = r.last_hidden_state, r.pooler_output
            elif name == "pretraining":
                out["prediction_logits"], out["nsp_logits"] = r.prediction_logits, r.seq_relationship_logits
            else:
                out["mlm_logits"] = r.logits
    model.save_pretrained(resaved)  # the masked-LM model, as transformers writes it
    torch.save(out, out_file)
""")


def test_preln_export_loads_exactly_with_remote_code(tmp_path: Path) -> None:
    ours, folder = _export(tmp_path, pre_layer_norm=True)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == PRELN_MODEL_TYPE and hf["architectures"] == ["BertpipePreLNForPreTraining"]
    assert {"AutoConfig", "AutoModel", "AutoModelForPreTraining", "AutoModelForMaskedLM"} <= hf["auto_map"].keys()
    package = Path(__file__).parents[1] / "bert_core" / "model"
    for name in PRELN_CODE_FILES:  # the package's files, byte for byte
        assert (folder / name).read_bytes() == (package / name).read_bytes()

    batch = _batch(folder)
    torch.save(batch, tmp_path / "batch.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    res = subprocess.run([sys.executable, "-c", LOAD_WITH_REMOTE_CODE, str(folder), str(tmp_path / "batch.pt"),
                          str(tmp_path / "out.pt"), str(tmp_path / "resaved")],
                         cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    assert (theirs["base.class"], theirs["pretraining.class"], theirs["mlm.class"]) == (
        "BertpipePreLNModel", "BertpipePreLNForPreTraining", "BertpipePreLNForMaskedLM")
    # every weight has its place: no load report of unused or freshly initialised weights
    assert not any(word in res.stderr for word in ("UNEXPECTED", "MISSING", "were not used", "newly initialized"))

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        out = ours.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                        output_hidden_states=True)
        logits = ours.mlm_logits(out.last_hidden_state)
        nsp = ours.cls.seq_relationship(out.pooler_output)
    # every position (bert_core's padding rows are 0 past the embeddings, and so are these)
    assert len(theirs["hidden_states"]) == len(out.hidden_states) == 3
    for i, (a, b) in enumerate(zip(out.hidden_states, theirs["hidden_states"], strict=True)):
        assert close(a, b), (i, (a - b).abs().max())
    assert close(out.last_hidden_state, theirs["last_hidden_state"])
    assert close(out.pooler_output, theirs["pooler_output"])
    assert close(logits, theirs["prediction_logits"]) and close(logits, theirs["mlm_logits"])
    assert close(nsp, theirs["nsp_logits"])
    # a folder transformers saved again (its own config.json, the code copied along) reads back in bert_core
    cfg, _ = load_pretrained(str(tmp_path / "resaved"))
    assert cfg.pre_layer_norm
    back = BertModel.from_pretrained(str(tmp_path / "resaved")).eval()
    with torch.no_grad():
        again = back(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).last_hidden_state
    assert torch.equal(again, out.last_hidden_state)


def test_preln_export_without_trust_remote_code_is_refused(tmp_path: Path, monkeypatch) -> None:
    _, folder = _export(tmp_path, pre_layer_norm=True)
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModel.from_pretrained(str(folder), trust_remote_code=False)
    # left out, transformers asks on the terminal; the answer "no" refuses too
    monkeypatch.setattr("builtins.input", lambda *args: "n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModel.from_pretrained(str(folder))
    # the tokenizer needs no code of ours
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    assert tok.tokenize("The cat") == ["the", "cat"]


def test_bert_core_reads_preln_exports_new_and_old(tmp_path: Path) -> None:
    ours, folder = _export(tmp_path, pre_layer_norm=True)
    back = BertForPreTraining.from_pretrained(str(folder))
    assert back.config == ours.config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    # an export from before the model type: model_type bert and the pre_layer_norm key
    hf = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k != "auto_map"} | {"model_type": "bert", "architectures": ["BertForPreTraining"]}
    assert model_config_from_hf(old) == model_config_from_hf(hf) == ours.config
    assert not model_config_from_hf(hf | {"model_type": "bert", "pre_layer_norm": False}).pre_layer_norm


def test_postln_export_stays_transformers_bert(tmp_path: Path) -> None:
    ours, folder = _export(tmp_path, pre_layer_norm=False)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "bert" and "auto_map" not in hf and "pre_layer_norm" not in hf
    assert not any((folder / name).exists() for name in PRELN_CODE_FILES)
    batch = _batch(folder)
    ref = transformers.AutoModel.from_pretrained(str(folder)).eval()  # no trust_remote_code needed
    assert type(ref) is transformers.BertModel
    with torch.no_grad():
        a = ours.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], output_hidden_states=True)
        b = ref(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    assert len(a.hidden_states) == len(b.hidden_states) == 3
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        assert torch.allclose(x[real], y[real], rtol=1e-5, atol=1e-5)
    assert torch.allclose(a.pooler_output, b.pooler_output, rtol=1e-5, atol=1e-5)
