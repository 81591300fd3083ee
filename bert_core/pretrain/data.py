"""Pre-training data loader: instance shards -> padded micro-batches with the model's unpadding
indices, deterministic and exactly resumable.

    loader = PretrainingLoader(instances_uri, max_seq_length=128, micro_batch_size=16,
                               rank=0, world_size=2, seed=42)
    for batch in loader: ...            # endless: epochs advance by themselves
    state = loader.state_dict()         # {"epoch": e, "position": micro-batches taken in epoch e}
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby, islice
from typing import TYPE_CHECKING, Any

import numpy as np

from bert_core import storage
from bert_core.config import ConfigError
from bert_core.failures import Refusal
from bert_core.instances.masking import MaskingSpec, mask_instances
from bert_core.instances.pairs import VocabIds, stable_hash

if TYPE_CHECKING:  # pyarrow and torch are imported where used
    import pyarrow as pa
    import torch

# Who reads what: the shards of ``<instances>/seq{L}/`` are split over *readers* = ranks x loader
# workers; reader ``k = rank * W + w`` owns shards ``k, k + R, k + 2R, ...`` (R readers). Each reader
# walks its shards in an order drawn from ``(seed, epoch, reader)`` and the rows of each shard in
# an order drawn from ``(seed, epoch, reader, shard)``: a two-level shuffle that needs one shard in
# memory, not the corpus (the instance stage already scattered instances over shards at random).
#
# Every reader yields the same number of micro-batches per epoch, ``min(rows of a reader) //
# micro_batch_size`` over *all* readers, so every rank takes the same number of steps and none
# waits forever in an all-reduce. The rows past that count are the tail of an epoch's
# permutation, a different tail every epoch.
#
# A rank's micro-batch ``j`` of an epoch is reader ``j % W``'s batch ``j // W``. Exact resume: the
# loader's state is (epoch, position); a reader starts at its batch ``ceil((position - w) / W)``,
# turns that into a row offset, skips whole shards by their manifest counts and indexes into the
# shard's permutation. Nothing is replayed, so resuming is instant.
#
# A batch is padded to its longest sequence rounded up to 8 (tensor-core friendly, few shapes),
# or with ``token_buckets`` to the phase's length and ``max_predictions_per_seq`` (fixed shapes);
# ``masked_lm_weights`` is 1 for a real prediction and 0 for padding. With ``masking: dynamic``
# in the instances manifest, the stored sequences are unmasked and each sample is masked here by
# ``bert_core.instances.masking`` (the instance stage's own masking) with the key
# ``stable_hash(seed, "mask", epoch, shard, row)``: a new mask every epoch, the same mask after a
# resume.

PAD_MULTIPLE = 8
COLUMNS = ["input_ids", "len_a", "masked_lm_positions", "masked_lm_ids", "next_sentence_label"]


class InstanceDataError(ValueError, Refusal):
    """Instance shards that cannot be trained on; the message names the shard and what to do."""


@dataclass(frozen=True)
class Shard:
    uri: str
    rows: int


# --------------------------------------------------------------------------- instances folder


def length_folder(instances: str, max_seq_length: int) -> str:
    return storage.join(instances, f"seq{max_seq_length}")


def vocab_file_of(
    instances: str, manifest: dict[str, Any] | None = None, fallback: str | None = None
) -> str:
    """The ``vocab.txt`` the instances were tokenized with, checked against the sha256 they
    recorded (:func:`check_vocab`): the one the manifest names, else the vocab stage among its
    inputs, else ``fallback`` (``vocab.vocab_file`` of the config, for older manifests). A vocab
    the manifest names is looked for where it is now (``storage.relocated``)."""
    manifest = manifest or storage.read_manifest(instances)
    vocab = manifest.get("vocab_file")
    for entry in manifest.get("inputs", []):
        if not vocab and entry.get("stage") == "vocab" and entry.get("uri"):
            vocab = storage.join(entry["uri"], "vocab.txt")
    vocab = vocab or manifest.get("vocab") or (manifest.get("config") or {}).get("vocab_file")
    vocab = storage.relocated(manifest, vocab) if vocab else fallback
    if not vocab:
        raise InstanceDataError(
            f"{storage.join(instances, storage.MANIFEST)} names no vocab (no input with stage 'vocab'); "
            "set vocab.vocab_file to the vocab.txt the instances were made with"
        )
    vocab_file = vocab if vocab.endswith(".txt") else storage.join(vocab, "vocab.txt")
    check_vocab(instances, vocab_file, manifest)
    return vocab_file


def check_vocab(instances: str, vocab_file: str, manifest: dict[str, Any] | None = None) -> None:
    """Refuse (:class:`InstanceDataError`, one line) a ``vocab.txt`` that is not the one the
    instances were made with: their ids index that vocab and no other. Instances that recorded
    no ``vocab_sha256`` cannot be checked."""
    manifest = manifest or storage.read_manifest(instances)
    recorded = manifest.get("vocab_sha256")
    if not recorded:
        return
    instances, vocab_file = storage.to_uri(instances), storage.to_uri(vocab_file)
    recorded_in = storage.join(instances, storage.MANIFEST)
    fix = (f"re-run instances for {instances} with this vocab, or restore the vocab.txt "
           "the instances were made with")
    if not storage.exists(vocab_file):
        raise InstanceDataError(f"{vocab_file}: the vocab {recorded_in} names is gone; {fix}")
    if storage.sha256(vocab_file) != recorded:
        raise InstanceDataError(
            f"{vocab_file} is not the vocab the instances were made with (its sha256 differs from "
            f"vocab_sha256 in {recorded_in}: was another vocab written into its folder?); {fix}"
        )


def read_vocab(vocab_file: str) -> list[str]:
    return storage.read_text(vocab_file).splitlines()


def vocab_ids(tokens: list[str], source: str = "vocab.txt") -> VocabIds:
    """Special ids, size and ``##`` pieces of a vocab, for dynamic masking."""
    index = {t: i for i, t in enumerate(tokens)}
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]") if t not in index]
    if missing:
        raise InstanceDataError(f"{source}: has no {', '.join(missing)}; use a BERT WordPiece vocab")
    subwords = frozenset(i for t, i in index.items() if t.startswith("##"))
    return VocabIds(index["[CLS]"], index["[SEP]"], index["[MASK]"], len(tokens), subwords)


def max_predictions_of(instances: str, max_seq_length: int, manifest: dict[str, Any] | None = None) -> int:
    """``max_predictions_per_seq`` of the instances' ``seq{max_seq_length}`` set, from the manifest."""
    cfg = (manifest or storage.read_manifest(instances)).get("config") or {}
    specs = [s for s in cfg.get("lengths", []) if s.get("max_seq_length") == max_seq_length]
    if not specs or "max_predictions_per_seq" not in specs[0]:
        raise InstanceDataError(
            f"{instances}: manifest config has no max_predictions_per_seq for max_seq_length="
            f"{max_seq_length}; re-run the instances stage"
        )
    return int(specs[0]["max_predictions_per_seq"])


def masking_spec(instances: str, max_seq_length: int, vocab_fallback: str | None = None) -> MaskingSpec | None:
    """None for static masking (masks stored in the shards); the spec for ``masking: dynamic``."""
    manifest = storage.read_manifest(instances)
    cfg = manifest.get("config") or {}
    if cfg.get("masking", "static") != "dynamic":
        return None
    max_predictions = max_predictions_of(instances, max_seq_length, manifest)
    vocab_file = vocab_file_of(instances, manifest, fallback=vocab_fallback)
    return MaskingSpec(
        masked_lm_prob=float(cfg.get("masked_lm_prob", 0.15)),
        max_predictions_per_seq=max_predictions,
        vocab=vocab_ids(read_vocab(vocab_file), vocab_file),
        whole_word_mask=bool(cfg.get("whole_word_mask", False)),
    )


def list_shards(instances: str, max_seq_length: int) -> list[Shard]:
    """The shards of ``seq{L}/`` with their row counts, from its manifest (never a listing)."""
    return folder_shards(length_folder(instances, max_seq_length))


def folder_shards(folder: str) -> list[Shard]:
    """The shards of an instances folder (``seq{L}/`` or ``seq{L}/eval/``) with their row counts."""
    import pyarrow.parquet as pq

    manifest = storage.read_manifest(folder)
    shards = []
    for entry in manifest["shards"]:
        uri = storage.join(folder, entry["path"])
        rows = entry.get("count")
        if rows is None:  # a shard entry without a count: the Parquet footer has it
            with storage.open_file(uri) as f:
                rows = pq.ParquetFile(f).metadata.num_rows
        shards.append(Shard(uri, int(rows)))
    if not shards:
        raise InstanceDataError(f"{folder}: manifest lists no shards; re-run the instances stage")
    return shards


# --------------------------------------------------------------------------- order


def epoch_rng(seed: int, epoch: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, *parts])


class Reader:
    """One reader's shards and its deterministic per-epoch sample order."""

    def __init__(self, shards: list[Shard], reader_id: int, seed: int) -> None:
        self.shards = shards
        self.reader_id = reader_id
        self.seed = seed
        self._order: tuple[tuple[int, int], np.ndarray] | None = None  # the last row_order drawn

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def shard_order(self, epoch: int) -> list[int]:
        return epoch_rng(self.seed, epoch, self.reader_id).permutation(len(self.shards)).tolist()

    def row_order(self, epoch: int, shard_index: int) -> np.ndarray:
        """The shard's row permutation of the epoch, drawn once per (epoch, shard) and kept."""
        key = (epoch, shard_index)
        if self._order is None or self._order[0] != key:
            rng = epoch_rng(self.seed, epoch, self.reader_id, 1 + shard_index)
            self._order = (key, rng.permutation(self.shards[shard_index].rows))
        return self._order[1]

    def samples(self, epoch: int, start: int) -> Iterator[tuple[int, int]]:
        """(shard index, row) from sample ``start`` of the epoch on; the shards before it are skipped unread."""
        for shard_index in self.shard_order(epoch):
            rows = self.shards[shard_index].rows
            if start >= rows:
                start -= rows
                continue
            for row in self.row_order(epoch, shard_index)[start:]:
                yield shard_index, int(row)
            start = 0


def split_shards(shards: list[Shard], num_readers: int) -> list[list[Shard]]:
    if len(shards) < num_readers:
        raise InstanceDataError(
            f"{len(shards)} instance shards for {num_readers} readers (ranks x loader workers): every "
            f"reader needs a shard; re-run the instances stage with num_shards >= {num_readers} "
            f"(or instances.shard_multiple_of={num_readers}), or use fewer ranks/workers"
        )
    return [shards[k::num_readers] for k in range(num_readers)]


# --------------------------------------------------------------------------- batches


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _pad_lists(lists: pa.ListArray, width: int, fill: int = 0) -> np.ndarray:
    """A list<int> column -> [rows, width] int64, right-padded with ``fill``."""
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    out = np.full((len(lengths), width), fill, dtype=np.int64)
    out[np.arange(width)[None, :] < lengths[:, None]] = values
    return out


def collate(table: pa.Table, max_seq_length: int, max_predictions: int | None = None) -> dict[str, np.ndarray]:
    """Instance rows (in order) -> padded arrays: the inputs of ``BertForPreTraining.forward``.
    With ``max_predictions`` the shapes are fixed: [B, max_seq_length] and [B, max_predictions]."""
    import pyarrow.compute as pc

    ids = table.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy()
    longest = int(lengths.max())
    if longest > max_seq_length:
        raise InstanceDataError(
            f"an instance has {longest} tokens but this phase reads seq{max_seq_length}; the shard "
            "does not match its folder, re-run the instances stage"
        )
    T = min(round_up(longest), round_up(max_seq_length))
    positions = table.column("masked_lm_positions").combine_chunks()
    P = round_up(int(pc.list_value_length(positions).to_numpy().max(initial=1)))
    if max_predictions is not None:
        if P > round_up(max_predictions):
            raise InstanceDataError(
                f"an instance has more than max_predictions_per_seq={max_predictions} masked "
                "positions; the shard does not match its manifest, re-run the instances stage"
            )
        T, P = round_up(max_seq_length), round_up(max_predictions)
    input_ids = _pad_lists(ids, T)  # [B, T]
    arange = np.arange(T)[None, :]
    len_a = table.column("len_a").to_numpy().astype(np.int64)[:, None]
    masked_lm_positions = _pad_lists(positions, P)  # [B, P]
    n_masked = np.diff(positions.offsets.to_numpy())
    return {
        "input_ids": input_ids,
        "token_type_ids": ((arange >= len_a) & (arange < lengths[:, None])).astype(np.int64),
        "attention_mask": (arange < lengths[:, None]).astype(np.int64),
        "masked_lm_positions": masked_lm_positions,
        "masked_lm_ids": _pad_lists(table.column("masked_lm_ids").combine_chunks(), P),
        "masked_lm_weights": (np.arange(P)[None, :] < n_masked[:, None]).astype(np.float32),
        "next_sentence_label": table.column("next_sentence_label").to_numpy().astype(np.int64),
    }


def mask_rows(table: pa.Table, spec: MaskingSpec, keys: np.ndarray) -> pa.Table:
    """Dynamic masking: the (empty) masked_lm columns filled with fresh predictions, row ``i``
    masked with ``keys[i]``."""
    import pyarrow as pa

    ids = table.column("input_ids").combine_chunks()
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    masked = mask_instances(keys, values, offsets - offsets[0], table.column("len_a").to_numpy(), spec)

    def lists(row_offsets: np.ndarray, flat: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(row_offsets.astype(np.int32)), pa.array(flat, pa.int32()))

    columns = {"input_ids": lists(offsets - offsets[0], masked.input_ids),
               "masked_lm_positions": lists(masked.mask_offsets, masked.masked_lm_positions),
               "masked_lm_ids": lists(masked.mask_offsets, masked.masked_lm_ids)}
    for name, column in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def to_tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    import torch

    return {k: torch.from_numpy(v) for k, v in batch.items()}


def model_inputs(batch: dict[str, np.ndarray], token_buckets: int = 0) -> dict[str, Any]:
    """A collated batch as the keyword arguments of ``BertForPreTraining.forward``, with the
    unpadding indices and masked-LM labels computed here, on the host (the loader's workers),
    so the forward pass never waits for them."""
    from bert_core.model.bert import pretraining_plan

    tensors = to_tensors(batch)
    return tensors | pretraining_plan(tensors["attention_mask"], tensors["masked_lm_positions"],
                                      tensors["masked_lm_ids"], tensors["masked_lm_weights"], token_buckets)


def to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """Tensors to ``device`` (asynchronously from pinned memory); flags stay on the host."""
    return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}


# --------------------------------------------------------------------------- streams


class ReaderStream:
    """The micro-batches of some readers of one rank from (epoch, position) on, across epochs.

    Used in-process (``workers=0``) or as a torch ``IterableDataset`` (one reader per worker):
    one DataLoader serves the whole run, its workers living across epochs. On resume the readers
    are rotated so DataLoader worker 0 yields the rank's next batch: DataLoader takes iterable
    workers' outputs round-robin from worker 0, and an epoch's batch count is a multiple of the
    workers, so the rotation holds in every later epoch too.
    """

    def __init__(self, loader: PretrainingLoader, epoch: int, position: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.position = position

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch.utils.data

        L, W = self.loader, self.loader.workers_per_rank
        info = torch.utils.data.get_worker_info()
        epoch, position = self.epoch, self.position
        while True:
            if info is None:  # in-process: interleave all of this rank's readers
                js = range(position, L.batches_per_epoch)
            else:
                w = (info.id + self.position) % W  # the reader this worker serves, rotated for a resume
                js = range(position + (w - position) % W, L.batches_per_epoch, W)
            for j in js:
                yield model_inputs(L.batch(epoch, j), L.token_buckets)
            epoch, position = epoch + 1, 0


class PretrainingLoader:
    """Endless, deterministic micro-batches of one rank; ``state_dict()`` pins the next batch."""

    def __init__(
        self,
        instances: str,
        max_seq_length: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 42,
        workers: int = 0,
        vocab_file: str | None = None,
        pin_memory: bool = False,
        token_buckets: int = 0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.instances = storage.to_uri(instances)
        self.max_seq_length = max_seq_length
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.workers = workers
        self.workers_per_rank = max(1, workers)
        self.pin_memory = pin_memory
        self.masking = masking_spec(self.instances, max_seq_length, vocab_file)
        self.token_buckets = token_buckets  # > 0: static shapes (BertForPreTraining's plan)
        self.max_predictions = max_predictions_of(self.instances, max_seq_length) if token_buckets else None
        all_readers = split_shards(list_shards(self.instances, max_seq_length),
                                   world_size * self.workers_per_rank)
        per_reader = min(sum(s.rows for s in shards) for shards in all_readers) // micro_batch_size
        if per_reader == 0:
            raise InstanceDataError(
                f"{length_folder(self.instances, max_seq_length)}: the smallest reader's shards hold "
                f"fewer than micro_batch_size={micro_batch_size} instances; create more instances, "
                "use fewer shards/ranks/workers or a smaller micro_batch_size"
            )
        first = rank * self.workers_per_rank
        self.readers = [Reader(all_readers[first + w], first + w, seed) for w in range(self.workers_per_rank)]
        self.batches_per_epoch = per_reader * self.workers_per_rank
        self.epoch = 0
        self.position = 0
        self._table: tuple[str, pa.Table] | None = None  # the one shard held in memory

    # ---- state
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "workers_per_rank": self.workers_per_rank,
                "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "world_size", "workers_per_rank", "micro_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"loader state was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}: an exact resume needs the same setting "
                    "(or start a new run from the checkpoint's weights)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # ---- batches
    def batch(self, epoch: int, j: int) -> dict[str, np.ndarray]:
        """The rank's micro-batch ``j`` of ``epoch``, as padded numpy arrays."""
        import pyarrow as pa

        W, mbs = self.workers_per_rank, self.micro_batch_size
        reader = self.readers[j % W]
        start = (j // W) * mbs
        picks = list(islice(reader.samples(epoch, start), mbs))
        # consecutive picks from one shard are read together, in batch order
        table = pa.concat_tables([
            self._read(reader.shards[shard_index].uri).take([row for _, row in group])
            for shard_index, group in groupby(picks, key=lambda pick: pick[0])
        ])
        if self.masking is not None:
            keys = np.array([stable_hash(self.seed, "mask", epoch, reader.shards[s].uri.rsplit("/", 1)[-1], r)
                             for s, r in picks], dtype=np.uint64)
            table = mask_rows(table, self.masking, keys)
        try:
            return collate(table, self.max_seq_length, self.max_predictions)
        except InstanceDataError as err:
            shards = sorted({reader.shards[s].uri for s, _ in picks})
            raise InstanceDataError(f"{', '.join(shards)}: {err}") from None

    def _read(self, uri: str) -> pa.Table:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._table is None or self._table[0] != uri:
            try:
                with storage.open_file(uri) as f:
                    table = pq.read_table(f, columns=COLUMNS)
            except (pa.ArrowException, OSError) as err:
                folder = uri.rsplit("/", 1)[0]
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                raise InstanceDataError(
                    f"{uri}: cannot read this instance shard ({reason}); the instances stage wrote it: "
                    f"re-run that stage (`bertpipe verify {folder}` checks every shard)"
                ) from None
            self._table = (uri, table)
        return self._table[1]

    def stream(self, epoch: int, position: int = 0) -> Iterator[dict[str, Any]]:
        """Model inputs from batch ``position`` of ``epoch`` on, endless, through DataLoader
        workers when configured (pinned for a fast copy to the GPU when ``pin_memory``)."""
        stream = ReaderStream(self, epoch, position)
        if self.workers == 0:
            if not self.pin_memory:
                return iter(stream)
            return (_pinned(batch) for batch in stream)
        import multiprocessing

        import torch.utils.data

        # Workers come from a forkserver, not a fork of this process: a fork copies whatever
        # threads and atexit state the parent has (Prefect, gloo) and may die on exit. The
        # server imports this module (torch, pyarrow) once; the workers fork from it.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch.utils.data", "pyarrow.parquet", "bert_core.pretrain.data"])
        return iter(torch.utils.data.DataLoader(
            _torch_stream_class()(stream), batch_size=None, num_workers=self.workers,
            collate_fn=_identity, multiprocessing_context=context, pin_memory=self.pin_memory,
            prefetch_factor=4,
        ))

    def __getstate__(self) -> dict[str, Any]:
        # Sent to each worker: without the cached shard (a worker reads its own).
        return {**self.__dict__, "_table": None}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Model inputs (see :func:`model_inputs`), endless; ``state_dict()`` follows them."""
        for batch in self.stream(self.epoch, self.position):
            self.position += 1
            if self.position == self.batches_per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
            yield batch


def _pinned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}


def _identity(batch: Any) -> Any:
    return batch


def _torch_stream_class() -> type:
    """``TorchStream``: a :class:`ReaderStream` as a torch ``IterableDataset``, for DataLoader
    workers. Built on first use so importing this module does not import torch; published as
    ``bert_core.pretrain.data.TorchStream`` (module ``__getattr__``) so a worker can unpickle it by name."""
    cls = globals().get("TorchStream")
    if cls is None:
        import torch.utils.data

        class TorchStream(torch.utils.data.IterableDataset):
            def __init__(self, stream: ReaderStream) -> None:
                self.stream = stream

            def __iter__(self) -> Iterator[dict[str, Any]]:
                return iter(self.stream)

        TorchStream.__qualname__ = "TorchStream"
        cls = globals()["TorchStream"] = TorchStream
    return cls


def __getattr__(name: str) -> Any:
    if name == "TorchStream":
        return _torch_stream_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
