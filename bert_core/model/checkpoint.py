"""Load and save BERT weights in the transformers layout (config.json + model.safetensors + vocab.txt).

    python -c "from bert_core.model.checkpoint import load_pretrained; print(load_pretrained('samples/models/minilm')[0])"

Our parameter names equal transformers' (see ``bert_core/model/bert.py``), so a state dict maps
1:1 but for :func:`normalize_state_dict`'s translations. Every read and write goes through
``bert_core.storage``, so ``gs://`` folders work like local ones. This module knows weights
and configs only, never the model classes.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bert_core import storage
from bert_core.config import ModelConfig
from bert_core.failures import Refusal

log = logging.getLogger(__name__)

WEIGHTS_SAFETENSORS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_BIN = "pytorch_model.bin"
_ENCODER_PARTS = ("embeddings.", "encoder.", "pooler.")
_HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new",
           "gelu_fast": "gelu_new", "relu": "relu"}
_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  "max_position_embeddings", "type_vocab_size", "initializer_range", "layer_norm_eps")


# A pre-LN model has a model type of its own, so that transformers' Auto classes never build it as
# their post-LN BERT: its config.json points ``auto_map`` at modeling code written beside the
# weights (these two files of this package, which import torch and transformers only).
PRELN_MODEL_TYPE = "bertpipe-preln-bert"
PRELN_CODE_FILES = ("configuration_bertpipe_preln.py", "modeling_bertpipe_preln.py")
_PRELN_ARCHITECTURES = {"BertForPreTraining": "BertpipePreLNForPreTraining", "BertModel": "BertpipePreLNModel",
                        "BertForSequenceClassification": "BertpipePreLNForSequenceClassification",
                        "BertForQuestionAnswering": "BertpipePreLNForQuestionAnswering",
                        "BertForTokenClassification": "BertpipePreLNForTokenClassification",
                        "BertForMultipleChoice": "BertpipePreLNForMultipleChoice"}
_PRELN_AUTO_MAP = {
    "AutoConfig": "configuration_bertpipe_preln.BertpipePreLNConfig",
    "AutoModel": "modeling_bertpipe_preln.BertpipePreLNModel",
    "AutoModelForPreTraining": "modeling_bertpipe_preln.BertpipePreLNForPreTraining",
    "AutoModelForMaskedLM": "modeling_bertpipe_preln.BertpipePreLNForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_bertpipe_preln.BertpipePreLNForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_bertpipe_preln.BertpipePreLNForQuestionAnswering",
    "AutoModelForTokenClassification": "modeling_bertpipe_preln.BertpipePreLNForTokenClassification",
    "AutoModelForMultipleChoice": "modeling_bertpipe_preln.BertpipePreLNForMultipleChoice",
}


class CheckpointError(ValueError, Refusal):
    """A checkpoint folder that cannot be loaded; the message names the file and what to do."""


# --------------------------------------------------------------------------- DeepSpeed files


def _deepspeed_checkpoint_types() -> list[type]:
    """The non-tensor classes DeepSpeed's ``save_checkpoint`` pickles (ZeRO optimizer shards,
    loss scalers); everything else in its files is tensors, containers, numbers and strings."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Inside, every ``torch.load`` reads weights only, whatever its caller asks for.

    DeepSpeed loads its checkpoints with ``torch.load(weights_only=False)``, which runs any code
    pickled into a ``.pt`` file. Run folders sit on shared mounts, so a resume or an export reads
    them through this: tensors, containers, numbers, strings and DeepSpeed's few own types load;
    any other pickled object raises ``pickle.UnpicklingError`` and nothing of it runs.
    """
    original = torch.load

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(f, map_location, **kwargs)

    with torch.serialization.safe_globals(_deepspeed_checkpoint_types()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


# --------------------------------------------------------------------------- config


def model_config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """transformers ``BertConfig`` dict -> :class:`ModelConfig` (size ``custom``). Pre-LN: the
    model type :data:`PRELN_MODEL_TYPE`, or (exports before it) ``bert`` with ``pre_layer_norm``."""
    model_type = hf.get("model_type", "bert")
    if model_type not in ("bert", PRELN_MODEL_TYPE):
        raise CheckpointError(f"{source}: model_type={model_type!r} is not a BERT model")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"{source}: position_embedding_type={hf['position_embedding_type']!r} is not supported "
            "(only absolute position embeddings, as in the paper)"
        )
    act = hf.get("hidden_act", "gelu")
    if act not in _HF_ACT:
        raise CheckpointError(f"{source}: hidden_act={act!r} is not supported; use gelu, gelu_new or relu")
    fields = {k: hf[k] for k in _CONFIG_FIELDS if k in hf}
    try:
        return ModelConfig(size="custom", hidden_act=_HF_ACT[act],
                           pre_layer_norm=model_type == PRELN_MODEL_TYPE or bool(hf.get("pre_layer_norm", False)),
                           **fields)
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None


def hf_config_from_model(cfg: ModelConfig, architecture: str = "BertForPreTraining") -> dict[str, Any]:
    """:class:`ModelConfig` -> a ``config.json`` dict: ``transformers.BertConfig``'s for a post-LN
    model, for a pre-LN one the same fields under :data:`PRELN_MODEL_TYPE`, with ``auto_map``
    naming the modeling code :func:`save_pretrained` writes beside it."""
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "bert",
        **{k: getattr(cfg, k) for k in _CONFIG_FIELDS},
        "hidden_act": cfg.hidden_act,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }
    if cfg.pre_layer_norm:
        # transformers has no pre-LN BERT: its Auto classes load this one with the code written
        # beside it (trust_remote_code=True) and refuse it without. The key keeps exports older
        # than the model type readable the same way.
        hf["architectures"] = [_PRELN_ARCHITECTURES.get(architecture, "BertpipePreLNModel")]
        hf["model_type"] = PRELN_MODEL_TYPE
        hf["auto_map"] = dict(_PRELN_AUTO_MAP)
        hf["pre_layer_norm"] = True
    return hf


def preln_code() -> dict[str, str]:
    """The pre-LN modeling code an export carries: file name -> source."""
    from importlib.resources import files

    return {name: files("bert_core.model").joinpath(name).read_text(encoding="utf-8") for name in PRELN_CODE_FILES}


# --------------------------------------------------------------------------- weights


def _read_bytes(uri: str) -> bytes:
    with storage.open_file(uri, "rb") as f:
        return f.read()


def _load_safetensors(uri: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(_read_bytes(uri))
    except (SafetensorError, ValueError) as err:
        raise CheckpointError(f"{storage.to_uri(uri)} is damaged ({err}); copy or export the "
                              "checkpoint again") from None


def _load_weights(folder: str) -> dict[str, torch.Tensor]:
    """Weights are read without unpickling code: safetensors, or ``torch.load(weights_only=True)``
    for ``pytorch_model.bin``.
    """
    single = storage.join(folder, WEIGHTS_SAFETENSORS)
    if storage.exists(single):
        return _load_safetensors(single)
    index = storage.join(folder, WEIGHTS_INDEX)
    if storage.exists(index):
        files = sorted(set(json.loads(storage.read_text(index))["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(_load_safetensors(storage.join(folder, name)))
        return state
    binary = storage.join(folder, WEIGHTS_BIN)
    if storage.exists(binary):
        try:  # weights_only: a checkpoint is data, never code to run
            return torch.load(io.BytesIO(_read_bytes(binary)), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"{binary}: not a plain tensor state dict ({err}); convert it to {WEIGHTS_SAFETENSORS}"
            ) from None
    raise CheckpointError(
        f"{storage.to_uri(folder)}: no {WEIGHTS_SAFETENSORS}, {WEIGHTS_INDEX} or {WEIGHTS_BIN}; "
        "point at a transformers-layout folder (or `bertpipe export` a DeepSpeed checkpoint first)"
    )


def normalize_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers/TF names -> ours: ``bert.`` prefix on encoder keys, gamma/beta -> weight/bias,
    a stored ``qkv`` split into query/key/value, tied decoder weight and the ``position_ids``
    buffer dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")  # DDP / DeepSpeed wrappers
        if key.endswith("LayerNorm.gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith("LayerNorm.beta"):
            key = key[: -len("beta")] + "bias"
        if key.startswith(_ENCODER_PARTS):
            key = "bert." + key
        if key.endswith("embeddings.position_ids") or key == "cls.predictions.decoder.weight":
            continue  # a buffer we compute, and a tie to bert.embeddings.word_embeddings.weight
        if key == "cls.predictions.decoder.bias":
            out.setdefault("cls.predictions.bias", value)
            continue
        if key.endswith((".self.qkv.weight", ".self.qkv.bias")):  # our stored q/k/v (a ZeRO checkpoint)
            prefix, kind = key.rsplit(".qkv.", 1)
            for name, part in zip(("query", "key", "value"), value.chunk(3), strict=True):
                out[f"{prefix}.{name}.{kind}"] = part.clone()
            continue
        out[key] = value
    return out


def load_pretrained(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a transformers-layout folder -> (config, state dict with ``bert.``-prefixed keys)."""
    cfg_uri = storage.join(path, "config.json")
    if not storage.exists(cfg_uri):
        raise CheckpointError(
            f"{cfg_uri} does not exist; point at a folder with config.json and model.safetensors "
            "(a transformers model folder or the output of `bertpipe export`)"
        )
    try:
        hf = json.loads(storage.read_text(cfg_uri))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg_uri}: not valid JSON ({err})") from None
    return model_config_from_hf(hf, source=cfg_uri), normalize_state_dict(_load_weights(path))


def _is_encoder(model: nn.Module) -> bool:
    """A bare ``BertModel`` (keys ``embeddings.*``), not a model around one (keys ``bert.*``)."""
    return not isinstance(getattr(model, "bert", None), nn.Module)


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Copy a normalised state dict into ``model`` (a ``BertModel`` or anything with ``.bert``).

    Missing encoder weights are an error; missing heads keep their fresh init (logged); keys the
    model has no place for (e.g. ``cls.*`` when loading a bare encoder) are ignored (logged).
    """
    state = normalize_state_dict(state)
    if _is_encoder(model):
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
        encoder_prefix = ("embeddings.", "encoder.")
    else:
        encoder_prefix = ("bert.embeddings.", "bert.encoder.")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    bad_encoder = [k for k in missing if k.startswith(encoder_prefix)]
    if bad_encoder:
        raise CheckpointError(
            f"{source}: {len(bad_encoder)} encoder weights missing (e.g. {bad_encoder[:3]}); "
            "the folder is not a BERT checkpoint of this shape"
        )
    shapes = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
              for k, v in own.items() if k in state and state[k].shape != v.shape]
    if shapes:
        raise CheckpointError(f"{source}: shape mismatch with config.json: {shapes[:3]}")
    unexpected = [k for k in state if k not in own]
    if missing:
        log.warning("%s: %d weights not in the checkpoint, freshly initialised: %s",
                    source, len(missing), missing[:6])
    if unexpected:
        log.info("%s: ignored %d weights this model has no place for: %s",
                 source, len(unexpected), unexpected[:6])
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


# --------------------------------------------------------------------------- save


def save_pretrained(
    model: nn.Module,
    path: str,
    vocab_file: str | None = None,
    tokenizer_file: str | None = None,
    lowercase: bool = True,
) -> str:
    """Write ``model`` as a transformers folder: config.json, model.safetensors, vocab files.

    ``tokenizer_file`` defaults to the ``tokenizer.json`` beside ``vocab_file`` when there is one.
    transformers opens the result and computes the same outputs as here: a post-LN model as its
    own BERT (``model_type: bert``), a pre-LN one with the modeling code written beside the
    weights (``AutoModel.from_pretrained(path, trust_remote_code=True)``; without it refused). Its
    tokenizer needs no code: ``AutoTokenizer.from_pretrained(path, trust_remote_code=False)``
    (transformers 5 reads config.json first and, with the argument left out, asks).
    """
    cfg: ModelConfig = model.config
    if any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()):
        raise CheckpointError(
            f"{path}: the model's weights are partitioned by DeepSpeed ZeRO-3, saving would write empty "
            "tensors; export the DeepSpeed checkpoint instead (`bertpipe export CHECKPOINT_DIR`), or call "
            "this on every rank inside deepspeed.zero.GatheredParameters(model.parameters())"
        )
    is_encoder = _is_encoder(model)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if not is_encoder and "cls.predictions.bias" in state:
        # transformers keeps a decoder bias tied to predictions.bias; write both (cloned:
        # safetensors refuses shared storage) so every version finds the one it looks for.
        state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()
    architecture = "BertModel" if is_encoder else type(model).__name__
    return write_model_folder(path, cfg, state, architecture, vocab_file=vocab_file,
                              tokenizer_file=tokenizer_file, lowercase=lowercase)


def write_model_folder(
    path: str, cfg: ModelConfig, state: dict[str, torch.Tensor], architecture: str, *,
    vocab_file: str | None = None, tokenizer_file: str | None = None, lowercase: bool = True,
    extra_config: dict[str, Any] | None = None, files: dict[str, str] | None = None,
) -> str:
    """The transformers folder of a state dict (transformers' key names): the pre-LN code when
    the model is pre-LN, model.safetensors, the vocab files, ``files`` (name -> text, e.g. a model
    card), then config.json (:func:`hf_config_from_model` for ``architecture``, updated by
    ``extra_config``) last. Returns the folder's URI."""
    from safetensors.torch import save as save_safetensors

    storage.makedirs(path)
    if cfg.pre_layer_norm:
        for name, source in preln_code().items():
            storage.write_text(storage.join(path, name), source)
    with storage.open_file(storage.join(path, WEIGHTS_SAFETENSORS), "wb") as f:
        f.write(save_safetensors(state, metadata={"format": "pt"}))
    if vocab_file:
        storage.write_text(storage.join(path, "vocab.txt"), storage.read_text(vocab_file))
        if tokenizer_file is None:
            beside = vocab_file.rsplit("/", 1)[0] + "/tokenizer.json" if "/" in vocab_file else "tokenizer.json"
            tokenizer_file = beside if storage.exists(beside) else None
    if tokenizer_file:
        storage.write_text(storage.join(path, "tokenizer.json"), storage.read_text(tokenizer_file))
    if vocab_file or tokenizer_file:
        tok_cfg = {"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase,
                   "model_max_length": cfg.max_position_embeddings}
        storage.write_text(storage.join(path, "tokenizer_config.json"), json.dumps(tok_cfg, indent=2))
    for name, text in (files or {}).items():
        storage.write_text(storage.join(path, name), text)
    # config.json last: a folder with a config is a finished export.
    hf = hf_config_from_model(cfg, architecture) | (extra_config or {})
    storage.write_text(storage.join(path, "config.json"), json.dumps(hf, indent=2, sort_keys=True))
    return storage.to_uri(path)
