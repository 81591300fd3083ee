"""Held-out evaluation during pre-training: masked LM and next-sentence loss and accuracy on the
whole eval split of one sequence length, shared by all ranks.

    split = EvalSplit.open(instances, max_seq_length=128, batch_size=32, rank=r, world_size=W)
    if split is not None:
        row = evaluate(engine, split)   # the same numbers on every rank
    masked_lm_accuracy(model, sequences, tokenizer.mask_id, seed=0)   # any text, fixed masks

(``bert_core/pretrain/loop.py`` calls it every ``pretrain.eval_every`` steps and at the end of
each phase; ``pytest tests/test_pretrain_eval.py`` checks it.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from bert_core import storage
from bert_core.instances.pairs import stable_hash
from bert_core.pretrain.data import (
    COLUMNS,
    InstanceDataError,
    collate,
    folder_shards,
    length_folder,
    mask_rows,
    masking_spec,
    model_inputs,
    to_device,
)

# The eval split of ``<instances>/seq{L}/`` is ``seq{L}/eval/``: ``part-*.parquet`` shards and a
# ``_MANIFEST.json``, with the columns of the training shards. Instances without it have no
# evaluation. Its rows, in manifest order, are cut into batches of ``batch_size`` rows whatever the
# number of ranks; rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...``. Each rank adds up,
# in float64, the masked LM loss and correct predictions over the real predictions and the NSP
# loss and correct predictions over the labelled rows; one all-reduce gives the totals. Every batch
# is the same for 1 or N ranks, so only the order of the final sums differs.
#
# With ``masking: dynamic`` the eval sequences are stored unmasked; each row is masked here with the
# key ``stable_hash(seed, "eval", shard, row)``, the same predictions at every evaluation.
#
# Evaluation runs the model in eval mode (no dropout) without gradients and touches neither the
# training loader nor a random generator, so a resumed run trains exactly as an uninterrupted one.

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

EVAL_FOLDER = "eval"
# float64 sums: mlm loss, mlm correct, predictions, nsp loss, nsp correct, nsp rows, instances
SUMS = ("mlm_loss", "mlm_correct", "predictions", "nsp_loss", "nsp_correct", "nsp_rows", "instances")


def eval_folder(instances: str, max_seq_length: int) -> str:
    return storage.join(length_folder(instances, max_seq_length), EVAL_FOLDER)


def rank_batches(num_rows: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """Rank ``rank``'s eval batches as row ranges: batch ``b`` is rows ``[b * batch_size, ...)``
    and belongs to rank ``b % world_size``."""
    num_batches = -(-num_rows // batch_size)
    return [range(b * batch_size, min(num_rows, (b + 1) * batch_size))
            for b in range(rank, num_batches, world_size)]


class EvalSplit:
    """One rank's share of the eval split of one sequence length, held as unpadded Arrow tables."""

    def __init__(self, folder: str, max_seq_length: int, batches: list[pa.Table], num_rows: int,
                 steps: int | None = None, filler: pa.Table | None = None) -> None:
        self.folder = folder
        self.max_seq_length = max_seq_length
        self.batches = batches  # this rank's batches, in order
        self.num_rows = num_rows  # rows of the whole split
        self.steps = len(batches) if steps is None else steps  # forward passes of this rank
        self.filler = filler  # run (not counted) for the passes past ``batches`` in lockstep

    @classmethod
    def open(
        cls, instances: str, max_seq_length: int, batch_size: int, rank: int = 0, world_size: int = 1,
        seed: int = 42, vocab_file: str | None = None, lockstep: bool = False,
    ) -> EvalSplit | None:
        """Rank ``rank``'s share of ``seq{L}/eval/``, or None when the instances have no eval split.

        ``lockstep``: every rank makes the same number of forward passes (ZeRO-3 gathers the
        weights in every forward, with all ranks); a rank short of batches repeats batch 0 and
        does not count it.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = eval_folder(instances, max_seq_length)
        if not storage.has_manifest(folder):
            return None
        shards = folder_shards(folder)
        starts = np.cumsum([0] + [s.rows for s in shards])
        num_rows = int(starts[-1])
        if num_rows == 0:
            raise InstanceDataError(f"{folder}: the eval split has no rows; re-run the instances stage")
        mine = rank_batches(num_rows, batch_size, rank, world_size)
        steps = len(rank_batches(num_rows, batch_size, 0, world_size)) if lockstep else len(mine)
        spec = masking_spec(instances, max_seq_length, vocab_file)

        tables: dict[int, pa.Table] = {}

        def rows_of(rows: range) -> pa.Table:
            parts = []
            for i in np.flatnonzero((starts[:-1] < rows.stop) & (starts[1:] > rows.start)):
                if int(i) not in tables:
                    with storage.open_file(shards[i].uri) as f:
                        tables[int(i)] = pq.read_table(f, columns=COLUMNS)
                lo, hi = max(rows.start, starts[i]) - starts[i], min(rows.stop, starts[i + 1]) - starts[i]
                part = tables[int(i)].slice(int(lo), int(hi - lo))
                if spec is not None and not _has_masks(part):
                    name = shards[i].uri.rsplit("/", 1)[-1]
                    keys = np.array([stable_hash(seed, "eval", name, r) for r in range(lo, hi)], dtype=np.uint64)
                    part = mask_rows(part, spec, keys)
                parts.append(part)
            return pa.concat_tables(parts).combine_chunks()

        batches = [rows_of(rows) for rows in mine]
        filler = rows_of(range(0, min(batch_size, num_rows))) if steps > len(batches) else None
        return cls(folder, max_seq_length, batches, num_rows, steps, filler)


def _has_masks(table: pa.Table) -> bool:
    import pyarrow.compute as pc

    return bool(pc.sum(pc.list_value_length(table.column("masked_lm_positions"))).as_py() or 0)


def eval_sums(model: Any, split: EvalSplit, device: Any = "cpu") -> torch.Tensor:
    """This rank's float64 sums (see ``SUMS``) over its batches; ``model`` is a DeepSpeed engine
    or a ``BertForPreTraining``. The model is left in the mode it was in."""
    import torch

    training = model.training
    model.eval()
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)  # summed on the device
    try:
        with torch.no_grad():
            for k in range(split.steps):
                table = split.batches[k] if k < len(split.batches) else split.filler
                batch = model_inputs(collate(table, split.max_seq_length))
                predictions = batch["mlm_labels"].numel()
                nsp_rows = int(batch["next_sentence_label"].ge(0).sum())
                out = model(**to_device(batch, device))
                if k >= len(split.batches):
                    continue
                o = torch.stack([out["mlm_loss"], out["mlm_acc"], out["nsp_loss"], out["nsp_acc"]]).double()
                sums += torch.stack([
                    o[0] * predictions, torch.round(o[1] * predictions), o.new_tensor(predictions),
                    o[2] * nsp_rows, torch.round(o[3] * nsp_rows), o.new_tensor(nsp_rows),
                    o.new_tensor(batch["input_ids"].shape[0]),
                ])
    finally:
        model.train(training)
    return sums.cpu()


def eval_metrics(sums: torch.Tensor) -> dict[str, float]:
    """Totals over all ranks -> the eval row's numbers (loss = masked LM loss + NSP loss)."""
    s = dict(zip(SUMS, sums.tolist(), strict=True))
    mlm_loss = s["mlm_loss"] / max(s["predictions"], 1)
    nsp_loss = s["nsp_loss"] / max(s["nsp_rows"], 1)
    return {"loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss,
            "mlm_acc": s["mlm_correct"] / max(s["predictions"], 1),
            "nsp_loss": nsp_loss, "nsp_acc": s["nsp_correct"] / max(s["nsp_rows"], 1),
            "instances": int(s["instances"]), "predictions": int(s["predictions"])}


def evaluate(engine: Any, split: EvalSplit) -> dict[str, Any]:
    """The eval split's metrics over all ranks (every rank calls this and gets the same numbers)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    device = getattr(engine, "device", "cpu")
    sums = eval_sums(engine, split, device)
    if dist.is_available() and dist.is_initialized():
        sums = sums.to(device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    return eval_metrics(sums) | {"seconds": time.perf_counter() - t0}


def masked_lm_accuracy(model: Any, sequences: list[list[int]], mask_id: int, seed: int = 0,
                       masked_lm_prob: float = 0.15) -> dict[str, float]:
    """Masked-LM accuracy of a ``BertForPreTraining`` on ``sequences`` (``[CLS] ... [SEP]`` ids)
    that are not instances: in each, ``masked_lm_prob`` of the pieces between [CLS] and [SEP] (at
    least one) are replaced by [MASK], drawn in turn from ``numpy.random.default_rng(seed)``, so
    every model scored on the same sequences and seed sees the same masks. Each sequence is one
    forward pass without padding. The share predicted exactly, with the counts it is made of."""
    import torch

    rng = np.random.default_rng(seed)
    training = model.training
    model.eval()
    correct = predictions = 0
    try:
        with torch.no_grad():
            for ids in sequences:
                inner = np.arange(1, len(ids) - 1)
                if not len(inner):
                    continue
                picked = rng.choice(inner, max(1, round(masked_lm_prob * len(inner))), replace=False)
                masked = torch.tensor([ids])
                masked[0, picked] = mask_id
                hidden = model.bert(masked).last_hidden_state[0, picked]
                correct += int((model.mlm_logits(hidden).argmax(-1) == torch.tensor(ids)[picked]).sum())
                predictions += len(picked)
    finally:
        model.train(training)
    return {"mlm_acc": correct / max(predictions, 1), "mlm_correct": correct, "predictions": predictions}
