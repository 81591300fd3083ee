"""Export: any checkpoint we produce or read (a DeepSpeed run, a transformers folder) -> a
transformers-layout folder that transformers opens: a post-LN model as its own BERT
(``transformers.AutoModel.from_pretrained``), a pre-LN one with the modeling code written beside
its weights (``from_pretrained(..., trust_remote_code=True)``; see ``checkpoint.save_pretrained``).

    bertpipe export runs/demo/checkpoints --output runs/demo/hf

The export is read back and compared before it counts. A vocab other than the one a finished
run recorded (``vocab_sha256`` in its manifest) is refused.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import re

import torch

from bert_core import storage
from bert_core.card import write_card
from bert_core.config import ModelConfig
from bert_core.model.bert import BertForPreTraining
from bert_core.model.checkpoint import (
    CheckpointError,
    load_into,
    load_pretrained,
    model_config_from_hf,
    normalize_state_dict,
    save_pretrained,
    weights_only_loads,
)

log = logging.getLogger(__name__)


def is_deepspeed_checkpoint(path: str) -> bool:
    """A DeepSpeed ``save_checkpoint`` folder: a ``latest`` tag file or ``<tag>/*model_states.pt``."""
    return storage.exists(storage.join(path, "latest")) or bool(
        storage.glob(storage.join(path, "*", "*model_states.pt"))
    )


def _deepspeed_tag(path: str, tag: str | None) -> str:
    """The tag to read: the one asked for, else ``latest``'s, else (``latest`` missing, garbage or
    naming no folder) the newest tag with a model file."""
    if tag:
        return tag
    tags = sorted({u.rsplit("/", 2)[-2] for u in storage.glob(storage.join(path, "*", "*model_states.pt"))})
    latest = storage.join(path, "latest")
    if storage.exists(latest):
        named = storage.read_text(latest).strip()
        if named in tags:
            return named
        log.warning("%s names %r, which has no *model_states.pt; taking the newest tag instead", latest, named[:40])
    if not tags:
        raise CheckpointError(f"{storage.to_uri(path)}: no DeepSpeed checkpoint (no latest, no */*model_states.pt)")
    return max(tags, key=lambda t: int("".join(c for c in t if c.isdigit()) or 0))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def load_deepspeed_state_dict(path: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 model weights of a DeepSpeed checkpoint (the ``latest`` tag unless given).

    ZeRO (stage >= 1) and bf16 runs keep the fp32 master weights partitioned in the optimizer
    files, so DeepSpeed's own ``zero_to_fp32`` consolidates them (it needs a local folder), except
    the files of its ``BF16_Optimizer`` (bf16 at ZeRO 1), which it does not read: those are joined
    by :func:`_fp32_from_bf16_optimizer`. Stage 0 in fp32 has the full weights in
    ``mp_rank_00_model_states.pt``, read with ``weights_only=True``.
    """
    tag = _deepspeed_tag(path, tag)
    step_dir = storage.join(path, tag)
    # stage 0-2: mp_rank_00_model_states.pt; stage 3: zero_pp_rank_<r>_mp_rank_00_model_states.pt
    if not storage.glob(storage.join(step_dir, "*model_states.pt")):
        raise CheckpointError(f"{step_dir} has no *model_states.pt; is {tag!r} a finished checkpoint of this run?")
    model_file = storage.join(step_dir, "mp_rank_00_model_states.pt")
    partitioned = storage.glob(storage.join(step_dir, "*zero_pp_rank_*_optim_states.pt"))
    if partitioned:
        if not storage.is_local(path):
            raise CheckpointError(
                f"{storage.to_uri(path)}: ZeRO checkpoints are consolidated from a local folder; "
                "copy it locally first (gsutil -m cp -r ...)"
            )
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            with weights_only_loads():  # zero_to_fp32 would unpickle anything
                if "bf16_" in partitioned[0].rsplit("/", 1)[-1] and _is_bf16_optimizer(partitioned[0]):
                    state = _fp32_from_bf16_optimizer(model_file, partitioned)
                else:
                    state = get_fp32_state_dict_from_zero_checkpoint(storage.to_uri(path), tag=tag)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"{step_dir}: cannot read the ZeRO checkpoint ({_first_line(err)})") from None
    else:
        try:
            with storage.open_file(model_file, "rb") as f, weights_only_loads():
                blob = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
            raise CheckpointError(f"{model_file}: cannot read it ({_first_line(err)}); export another "
                                  "tag (--tag) or a run folder whose checkpoint is whole") from None
        state = blob["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in normalize_state_dict(state).items()}


def _optimizer_state(uri: str) -> dict:
    return torch.load(storage.to_uri(uri), map_location="cpu", weights_only=True)["optimizer_state_dict"]


def _is_bf16_optimizer(uri: str) -> bool:
    """A file of DeepSpeed's BF16_Optimizer: fp32 slices with fragment addresses, no ZeRO stage."""
    state = _optimizer_state(uri)
    return "param_slice_mappings" in state and "zero_stage" not in state


def _fp32_from_bf16_optimizer(model_file: str, optim_files: list[str]) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a BF16_Optimizer checkpoint: each rank's file holds its slice of
    every parameter group's flat fp32 buffer and, per parameter, the (start, numel) of the
    fragment that lies in it; the ranks' slices follow one another, so a parameter is its
    fragments joined in rank order. The bf16 model file gives the shapes and any buffers."""
    blob = torch.load(storage.to_uri(model_file), map_location="cpu", weights_only=True)
    shapes = {name: shape for group in blob["param_shapes"] for name, shape in group.items()}
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
    rank = re.compile(r"zero_pp_rank_(\d+)_")
    for uri in sorted(optim_files, key=lambda u: int(rank.search(u.rsplit("/", 1)[-1]).group(1))):
        state = _optimizer_state(uri)
        for flat, fragments in zip(state["single_partition_of_fp32_groups"], state["param_slice_mappings"],
                                   strict=True):
            for name, fragment in fragments.items():
                pieces[name].append(flat.narrow(0, fragment.start, fragment.numel))
    out = {k: v.float() if v.is_floating_point() else v for k, v in blob["module"].items()}
    for name, shape in shapes.items():
        joined = torch.cat(pieces[name]) if pieces[name] else torch.empty(0)
        if joined.numel() != shape.numel():
            raise CheckpointError(f"{model_file.rsplit('/', 1)[0]}: {name} has {joined.numel()} of its "
                                  f"{shape.numel()} fp32 values in the optimizer files; a rank's file is missing")
        out[name] = joined.view(shape).clone()
    return out


def model_config_from_state_dict(state: dict[str, torch.Tensor], like: ModelConfig) -> ModelConfig:
    """Sizes read off the weight shapes; what shapes cannot tell (heads, activation, eps) from ``like``."""
    state = normalize_state_dict(state)
    try:
        vocab, hidden = state["bert.embeddings.word_embeddings.weight"].shape
        positions = state["bert.embeddings.position_embeddings.weight"].shape[0]
        types = state["bert.embeddings.token_type_embeddings.weight"].shape[0]
        inter = state["bert.encoder.layer.0.intermediate.dense.weight"].shape[0]
    except KeyError as err:
        raise CheckpointError(f"not a BERT state dict: {err} missing") from None
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("bert.encoder.layer."))
    if like.hidden_size != hidden:
        raise CheckpointError(
            f"the checkpoint has hidden_size={hidden} but the config says {like.hidden_size}; "
            "pass the run's config (--preset/--config/--set model.*) so the head count is right"
        )
    return like.model_copy(update=dict(
        size="custom", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=inter, max_position_embeddings=positions, type_vocab_size=types,
        pre_layer_norm="bert.encoder.ln.weight" in state,
    ))


def check_run_vocab(vocab_file: str, *folders: str) -> None:
    """Refuse (:class:`CheckpointError`, one line) a ``vocab.txt`` other than the one the
    pre-training run among ``folders`` trained with (the ``vocab_sha256`` of its manifest): a
    model's ids mean something with that vocab only. Without a finished run nothing is known."""
    for folder in folders:
        if not storage.has_manifest(folder):
            continue
        manifest = storage.read_manifest(folder)
        recorded = manifest.get("vocab_sha256")
        if manifest.get("stage") != "pretrain" or not recorded:
            continue
        if storage.sha256(vocab_file) != recorded:
            run = storage.to_uri(folder)
            raise CheckpointError(
                f"{storage.to_uri(vocab_file)} is not the vocab the model was trained with (its sha256 "
                f"differs from vocab_sha256 in {storage.join(run, storage.MANIFEST)}); pass --vocab "
                f"{storage.join(run, 'hf', 'vocab.txt')} or leave --vocab out"
            )
        return


def _first_existing(*uris: str) -> str | None:
    return next((u for u in uris if storage.exists(u)), None)


def export_checkpoint(
    source: str,
    output: str,
    like: ModelConfig | None = None,
    vocab_file: str | None = None,
    tag: str | None = None,
    lowercase: bool = True,
) -> str:
    """Any checkpoint we produce or read -> a transformers folder at ``output``; returns its URI.

    ``source`` is a transformers/bert_core folder (``config.json`` + weights) or a DeepSpeed
    checkpoint folder. For DeepSpeed the model config comes from a ``config.json`` beside the
    checkpoint (or in its run folder, or the run's ``hf/`` export), else from the weight shapes
    plus ``like`` (the run's ``ModelConfig``). The vocab defaults to a ``vocab.txt`` in the same places.
    """
    # A pre-training run keeps one DeepSpeed folder per phase (checkpoints/phase<N>): take the last.
    if not is_deepspeed_checkpoint(source) and not storage.exists(storage.join(source, "config.json")):
        phases = [storage.join(source, f"phase{n}") for n in range(1, 10)]
        phases = [p for p in phases if is_deepspeed_checkpoint(p)]
        if phases:
            log.info("%s: exporting the last phase, %s", source, phases[-1])
            source = phases[-1]
    parent = source.rstrip("/").rsplit("/", 1)[0] if "/" in source.rstrip("/") else "."
    run = parent.rsplit("/", 1)[0] if "/" in parent else "."
    if storage.exists(storage.join(source, "config.json")) and not is_deepspeed_checkpoint(source):
        cfg, state = load_pretrained(source)
    elif is_deepspeed_checkpoint(source):
        state = load_deepspeed_state_dict(source, tag)
        # beside the checkpoint, in the run folder, or in the run's final export (runs/<run>/hf)
        cfg_uri = _first_existing(storage.join(source, "config.json"), storage.join(parent, "config.json"),
                                  storage.join(parent, "hf", "config.json"), storage.join(run, "hf", "config.json"))
        if cfg_uri:
            cfg = model_config_from_hf(json.loads(storage.read_text(cfg_uri)), source=cfg_uri)
        elif like is not None:
            cfg = model_config_from_state_dict(state, like)
        else:
            raise CheckpointError(
                f"{storage.to_uri(source)}: a DeepSpeed checkpoint without config.json; "
                "pass the run's config (--preset/--config) so the model shape is known"
            )
    else:
        raise CheckpointError(
            f"{storage.to_uri(source)}: neither a transformers folder (config.json) nor a DeepSpeed "
            "checkpoint (latest, global_step*/); point at runs/<run>/checkpoints or runs/<run>/hf"
        )
    model = BertForPreTraining(cfg)
    load_into(model, state, source=storage.to_uri(source))
    vocab_file = vocab_file or _first_existing(
        storage.join(source, "vocab.txt"), storage.join(parent, "vocab.txt"), storage.join(parent, "hf", "vocab.txt"),
        storage.join(run, "hf", "vocab.txt"),
    )
    if vocab_file is None:
        log.warning("%s: no vocab.txt found; the export has weights only (pass --vocab)", source)
    else:
        check_run_vocab(vocab_file, parent, run)
    out = save_pretrained(model, output, vocab_file=vocab_file, lowercase=lowercase)
    # Read it back: an export that does not load is worse than none.
    _, back = load_pretrained(out)
    for key, value in model.state_dict().items():
        if not torch.equal(back[key], value):
            raise CheckpointError(f"{out}: {key} differs after writing; the export is corrupt")
    runs = [storage.read_manifest(f) for f in (parent, run) if storage.has_manifest(f)]
    write_card(out, run_manifest=next((m for m in runs if m.get("stage") == "pretrain"), None))
    return out
