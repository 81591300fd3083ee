"""One typed config for the whole pipeline.

Every stage reads its settings from one of these pydantic models; everything else (Beam
``PipelineOptions``, the DeepSpeed config dict, the ``deepspeed`` launcher argv, Prefect flow
parameters) is rendered from them. Presets are YAML files in ``bert_core/presets/`` with the
shape of :class:`PipelineConfig`.

    bertpipe config show --preset demo --set instances.dupe_factor=2
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bert_core.failures import Refusal


class _Model(BaseModel):
    # Unknown keys are typos; refuse them so a misspelt setting never silently does nothing.
    """Base of every config model. Field names follow the BERT paper and google-research/bert
    (``masked_lm_prob``, ``max_predictions_per_seq``, ``short_seq_prob``, ``dupe_factor``, ...).
    """
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# A setting added after stages were first stored: it enters a stage's version only when set away
# from its default, so the stages stored before it keep their versions (config_hash).
VERSIONED_WHEN_SET = {"versioned": "when set"}


class ConfigError(ValueError, Refusal):
    """A config that cannot run. The message names the field and what to do."""


# --------------------------------------------------------------------------- corpus


class CorpusConfig(_Model):
    """Stage 1: raw Wikipedia dumps, book folders and text records -> document-level sentences."""

    wikipedia: list[str] = Field(
        default_factory=list,
        description="Globs/URIs of Wikipedia XML dumps (.xml, .xml.bz2, multistream .xml.bz2).",
    )
    books: list[str] = Field(
        default_factory=list, description="Globs/URIs of book files (.txt, .txt.gz), one book each."
    )
    text: list[str] = Field(
        default_factory=list, description="Globs/URIs of text record files: JSON lines (.jsonl, "
        ".jsonl.gz, .jsonl.zst) or Parquet (.parquet); one record = one document."
    )
    text_field: str = Field("text", min_length=1, description="Field (column) of a record holding its text.")
    id_field: str | None = Field(
        None, description="Field holding a record's id (doc_id 'text:<id>'); None = "
        "'text:<file stem>:<line or row>'."
    )
    title_field: str | None = Field(
        None, description="Field holding a record's title; None = the file stem and the record's line or row."
    )
    min_sentences_per_doc: int = Field(
        2, ge=1, description="Documents with fewer sentences are rejected (too_few_sentences)."
    )
    min_chars_per_doc: int = Field(
        50, ge=0, description="Documents with fewer characters of text are rejected (too_short). "
        "Low on purpose: real stubs are short (enwiki's 'Aa River' is 2 sentences, 189 chars); "
        "pages that are only a list lead-in ('X may refer to:') already fail min_sentences_per_doc."
    )
    min_chars_per_sentence: int = Field(
        2, ge=1, description="Shorter sentences are removed from a document (not a reject)."
    )
    dedup_exact: bool = Field(True, description="Reject exact duplicates (hash of normalized text).")
    dedup_near: bool = Field(True, description="Reject near-duplicate documents with MinHash.")
    near_dup_threshold: float = Field(
        0.8, gt=0, le=1, description="Estimated Jaccard similarity of 5-gram shingles above "
        "which a document is a near duplicate of an earlier one."
    )
    minhash_num_perm: int = Field(128, ge=16, description="MinHash permutations (bands x rows).")
    num_shards: int = Field(0, ge=0, description="Output document shards; 0 = automatic.")
    allow_truncated: bool = Field(
        False, json_schema_extra=VERSIONED_WHEN_SET, description="Keep what was read from an input file that is cut short (a warning "
        "line per file) instead of failing the stage."
    )
    text_format: Literal["none", "google"] = Field(
        "none", description="'google' also writes one sentence per line, blank line between "
        "documents (google-research/bert's input format)."
    )


# --------------------------------------------------------------------------- vocab

MAX_WORDS = 300_000  # distinct words the WordPiece trainer is given (it holds about 1 KB a word)


class VocabConfig(_Model):
    """Stage 2: a WordPiece vocab trained with HF tokenizers (or an existing vocab.txt)."""

    vocab_file: str | None = Field(
        None, description="Use this existing vocab.txt instead of training one (only validated)."
    )
    vocab_size: int = Field(30522, ge=128, description="Size of the trained vocab, specials included.")
    lowercase: bool = Field(True, description="Uncased model: lowercase before tokenizing.")
    strip_accents: bool | None = Field(
        None, description="Strip accents; None follows `lowercase` (as BERT does)."
    )
    min_frequency: int = Field(2, ge=1, description="A merge must occur this often to be learnt.")
    limit_alphabet: int = Field(1000, ge=1, description="Most frequent characters kept as the alphabet.")
    max_words: int = Field(
        MAX_WORDS, ge=1, description="Most distinct words given to the WordPiece trainer, which holds "
        "each of them (its memory): beyond this, the least frequent words are left out (all words "
        "of the count at the cut), and the manifest counts them. A corpus with fewer distinct "
        "words gets the same vocab as without the bound."
    )
    num_unused: int = Field(
        100, ge=0, description="[unusedN] slots reserved after [PAD] for later task tokens."
    )
    max_input_chars_per_word: int = Field(
        200, ge=1, description="Longer words become [UNK]. Google uses 200, transformers 100."
    )

    @property
    def do_strip_accents(self) -> bool:
        return self.lowercase if self.strip_accents is None else self.strip_accents


# --------------------------------------------------------------------------- instances


class SequenceSpec(_Model):
    """One output length of the instance stage (phase 1 uses 128, phase 2 uses 512)."""

    max_seq_length: int = Field(128, ge=8, le=8192, description="Tokens per instance, incl. specials.")
    max_predictions_per_seq: int = Field(
        20, ge=1, description="Most masked positions per instance (paper: 20 at 128, 80 at 512)."
    )

    @model_validator(mode="after")
    def _check(self) -> SequenceSpec:
        if self.max_predictions_per_seq > self.max_seq_length - 3:
            raise ValueError(
                f"max_predictions_per_seq={self.max_predictions_per_seq} cannot exceed "
                f"max_seq_length - 3 = {self.max_seq_length - 3} (the tokens that can be masked); "
                "lower max_predictions_per_seq or raise max_seq_length"
            )
        return self


class InstanceConfig(_Model):
    """Stage 3: masked-LM + next-sentence instances (create_pretraining_data.py's algorithm),
    with an eval split held out by document."""

    lengths: list[SequenceSpec] = Field(
        default_factory=lambda: [SequenceSpec()],
        description="One instance set per entry, written to seq{max_seq_length}/.",
    )
    masked_lm_prob: float = Field(0.15, gt=0, lt=1, description="Share of tokens to predict.")
    short_seq_prob: float = Field(
        0.1, ge=0, le=1, description="Probability of a shorter random target length per document."
    )
    dupe_factor: int = Field(10, ge=1, description="Passes over the corpus with different masks.")
    whole_word_mask: bool = Field(False, description="Mask all word pieces of a word together.")
    next_sentence_prediction: bool = Field(
        True, description="False: packed segments without B and without NSP labels (RoBERTa)."
    )
    masking: Literal["static", "dynamic"] = Field(
        "static", description="'dynamic' stores unmasked sequences; the loader masks each epoch."
    )
    seed: int = Field(12345, description="Every RNG is seeded from (seed, doc_id, dupe_index).")
    num_shards: int = Field(0, ge=0, description="Shards per length; 0 = automatic.")
    shard_multiple_of: int = Field(
        1, ge=1, description="Round the shard count up to a multiple of this (world size x loader workers)."
    )
    random_doc_buckets: int = Field(
        64, ge=1, description="Documents are hashed into this many buckets; a random-next B "
        "segment comes from another document of the same bucket (bounded memory)."
    )
    max_pool_tokens: int = Field(
        1 << 23, ge=1000, description="Tokens a bucket averages at most (estimated from the "
        "corpus's Parquet footers): more buckets for a corpus of long documents, since a worker "
        "holds one bucket's tokens (2 bytes each for a vocab under 65,536)."
    )
    eval_fraction: float = Field(
        0.01, ge=0, le=0.5, description="Share of documents held out as the eval split "
        "(seq{L}/eval/): the split is by document, so no eval text reaches a training instance, "
        "not even as a random-next B segment. Eval instances are made in one pass (dupe_factor 1). "
        "0 = no eval split."
    )
    min_eval_documents: int = Field(
        10, ge=0, description="Hold out about this many documents in small corpora, never more "
        "than half; a corpus of fewer than twice this many documents gets no eval split."
    )


# --------------------------------------------------------------------------- model


MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


class ModelConfig(_Model):
    """The encoder. Field names equal transformers' BertConfig so config.json reads back unchanged."""

    size: Literal["tiny", "mini", "small", "base", "large", "custom"] = Field(
        "base", description="Named size; fills the four size fields not given explicitly."
    )
    vocab_size: int | None = Field(None, ge=8, description="None = taken from the vocab stage.")
    hidden_size: int = Field(768, ge=8)
    num_hidden_layers: int = Field(12, ge=1)
    num_attention_heads: int = Field(12, ge=1)
    intermediate_size: int = Field(3072, ge=8)
    hidden_act: Literal["gelu", "gelu_new", "relu"] = "gelu"
    hidden_dropout_prob: float = Field(0.1, ge=0, lt=1)
    attention_probs_dropout_prob: float = Field(0.1, ge=0, lt=1)
    max_position_embeddings: int = Field(512, ge=8)
    type_vocab_size: int = Field(2, ge=1)
    initializer_range: float = Field(0.02, gt=0)
    layer_norm_eps: float = Field(1e-12, gt=0)
    pre_layer_norm: bool = Field(False, description="Pre-LN (stabler at large batch); paper is post-LN.")
    pad_vocab_to_multiple: int = Field(
        1, ge=1, json_schema_extra=VERSIONED_WHEN_SET, description="Round the embedding rows up to a multiple of this (64 on GPUs: tensor-core "
        "friendly shapes for the masked-LM decoder); the extra rows are no token's id, never an input "
        "and never a label. Not a transformers field: config.json records the padded vocab_size."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("size", "base") != "custom":
            size = data.get("size", "base")
            if size in MODEL_SIZES:
                data = {**MODEL_SIZES[size], **data}  # explicit fields win
        return data

    def for_vocab(self, vocab_size: int) -> ModelConfig:
        """This shape for a vocab of ``vocab_size`` tokens: ``vocab_size`` rows unless set here,
        rounded up to a multiple of ``pad_vocab_to_multiple``."""
        rows, multiple = self.vocab_size or vocab_size, self.pad_vocab_to_multiple
        return self.model_copy(update={"vocab_size": -(-rows // multiple) * multiple})

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; pick sizes where hidden_size % heads == 0"
            )
        return self


# --------------------------------------------------------------------------- pre-training


class PretrainPhase(_Model):
    """One pre-training phase (paper: 90% of steps at 128 tokens, the rest at 512)."""

    max_seq_length: int = Field(128, description="Which instance set (seq{L}/) this phase reads.")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps in this phase.")
    global_batch_size: int = Field(256, ge=1, description="Sequences per optimizer step, all ranks.")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per rank per forward pass.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup steps, then linear decay to 0.")


class PretrainConfig(_Model):
    """Stage 4: DeepSpeed pre-training (MLM + NSP)."""

    phases: list[PretrainPhase] = Field(default_factory=lambda: [PretrainPhase()])
    # where and how many
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="cpu = gloo ranks; gpu = nccl.")
    nodes: int = Field(1, ge=1, description="Machines.")
    procs_per_node: int = Field(2, ge=1, description="Ranks per machine (GPUs, or CPU processes).")
    launcher: Literal["local", "hostfile", "no_ssh"] = Field(
        "local", description="local: one machine; hostfile: ssh/pdsh to the hosts of `hostfile`; "
        "no_ssh: one launcher per node (Kubernetes pods) with --node_rank."
    )
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for launcher=hostfile.")
    master_addr: str = Field("127.0.0.1", description="Rendezvous address (rank 0's host).")
    master_port: int | None = Field(
        None, ge=1, le=65535, description="Rendezvous port; unset: a free port for launcher=local "
        "(runs side by side never collide), 29500 for the multi-node launchers."
    )
    # numerics
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32 on CPU. bf16 at zero_stage 0 is torch autocast over fp32 weights; at "
        "zero_stage >= 1 DeepSpeed's bf16 weights with fp32 master weights and gradients."
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    optimizer: Literal["adamw", "lamb"] = Field(
        "adamw", description="LAMB (per-layer trust ratio) for very large batches; needs zero_stage 0."
    )
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-6
    weight_decay: float = Field(0.01, ge=0, description="Not applied to bias and LayerNorm.")
    gradient_clipping: float = Field(1.0, ge=0)
    seed: int = 42
    launch_retries: int = Field(
        2, ge=0, description="Relaunches after an infrastructure failure (each resumes from the last "
        "checkpoint); config and data errors are never retried."
    )
    # bookkeeping
    log_every: int = Field(10, ge=1, description="Steps between metrics.jsonl lines.")
    checkpoint_every: int = Field(500, ge=1, description="Steps between checkpoints.")
    checkpoint_uri: str | None = Field(
        None, description="Where each complete checkpoint is copied (gs://B/P, s3://B/P with "
        "pip install 'bertpipe[s3]', any fsspec URI or a local folder): <checkpoint_uri>/<run folder's "
        "name>/checkpoints/phase{i}/step{N}/ with its _MANIFEST.json. A run folder without the newest "
        "of them (a new machine) resumes from the newest step there that has its manifest. Not part "
        "of the version."
    )
    eval_every: int = Field(
        0, ge=0, description="Steps between evaluations on the instances' eval split (seq{L}/eval); "
        "0 = only at the end of each phase, which always evaluates."
    )
    monitor: Literal["tensorboard", "csv", "wandb", "none"] = Field(
        "csv", description="DeepSpeed's monitor of the training loss and rate: csv and tensorboard under "
        "RUN/monitor/, wandb to Weights & Biases (WANDB_MODE=offline keeps it on disk; needs "
        "pip install 'bertpipe[wandb]').")
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    peak_flops_per_rank: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one rank, for the MFU estimate (e.g. 312e12 A100 bf16); "
        "None = from the device (H100/H200, A100 by name; none on CPU)."
    )
    compile: bool = Field(False, json_schema_extra=VERSIONED_WHEN_SET,
                          description="Run the model through torch.compile.")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", json_schema_extra=VERSIONED_WHEN_SET,
        description="torch.compile's backend; eager and aot_eager check the graph without generating code."
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = Field(
        "default", json_schema_extra=VERSIONED_WHEN_SET,
        description="torch.compile's mode; reduce-overhead replays CUDA graphs (needs token_buckets)."
    )
    token_buckets: int = Field(
        0, ge=0, json_schema_extra=VERSIONED_WHEN_SET,
        description="0: batch shapes follow each batch. n > 0: static shapes, so torch.compile "
        "compiles once per bucket: padded length = max_seq_length, masked rows = micro_batch_size "
        "x max_predictions_per_seq, real tokens rounded up to one of n sizes. The same losses (dropout masks aside)."
    )
    mlm_loss_chunk: int = Field(
        0, ge=0, json_schema_extra=VERSIONED_WHEN_SET,
        description="0: the masked-LM loss over all masked rows at once. n > 0: n rows at a time, each "
        "chunk's [n, vocab] logits recomputed in the backward pass instead of kept (less memory, one more "
        "decoder matmul). The same loss and gradients to fp32 rounding."
    )
    threads_per_rank: int = Field(1, ge=1, description="OMP/torch threads per rank on CPU.")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra=VERSIONED_WHEN_SET,
        description="DeepSpeed settings bertpipe does not type (offload, activation checkpointing, "
        "communication, profiling), merged over the rendered DeepSpeed config; a key DeepSpeed does not "
        "read, or one a typed setting sets, is refused (bert_core/pretrain/ds_config.py)."
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        problems: list[str] = []
        for i, p in enumerate(self.phases):
            per_step = self.world_size * p.micro_batch_size
            if p.global_batch_size % per_step:
                problems.append(
                    f"phases[{i}].global_batch_size={p.global_batch_size} is not divisible by "
                    f"ranks x micro_batch_size = {self.world_size} x {p.micro_batch_size} = {per_step}; "
                    f"use a multiple of {per_step} (e.g. {max(per_step, p.global_batch_size // per_step * per_step)})"
                )
            if p.warmup_steps > p.max_steps:
                problems.append(
                    f"phases[{i}].warmup_steps={p.warmup_steps} exceeds max_steps={p.max_steps}"
                )
        if self.monitor == "wandb" and importlib.util.find_spec("wandb") is None:
            problems.append("monitor=wandb needs the wandb package: pip install 'bertpipe[wandb]' "
                            "(or monitor=csv)")
        if self.launcher == "hostfile" and not self.hostfile:
            problems.append("launcher=hostfile needs pretrain.hostfile (a DeepSpeed hostfile path)")
        if self.accelerator == "cpu" and self.precision == "fp16":
            problems.append("precision=fp16 needs accelerator=gpu; use fp32 (or bf16) on CPU")
        if self.optimizer == "lamb" and self.zero_stage > 0:
            problems.append(
                f"optimizer=lamb with zero_stage={self.zero_stage}: ZeRO hands the optimizer flat "
                "partitions, so LAMB's trust ratio would be per partition, not per layer; use "
                "zero_stage: 0 (any precision), or optimizer: adamw"
            )
        if self.compile_mode != "default" and not self.compile:
            problems.append(f"compile_mode={self.compile_mode} needs compile: true")
        if self.compile_mode == "reduce-overhead" and not self.token_buckets:
            problems.append(
                "compile_mode=reduce-overhead records one CUDA graph per batch shape; set token_buckets "
                "(e.g. 8) so that there are a few shapes, not one per batch"
            )
        if self.compile_mode == "reduce-overhead":
            for i, p in enumerate(self.phases):
                micro_batches = p.global_batch_size // (self.world_size * p.micro_batch_size)
                if micro_batches > 1:
                    # A replayed CUDA graph writes the gradients into buffers allocated during its
                    # capture, so the next micro-batch of the step cannot add into them.
                    problems.append(
                        f"compile_mode=reduce-overhead with phases[{i}] taking {micro_batches} micro-batches "
                        "a step: CUDA graphs cannot accumulate gradients; set global_batch_size = ranks x "
                        "micro_batch_size, or compile_mode: default"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self


# --------------------------------------------------------------------------- fine-tuning


# Which checkpoints and tasks run, and where: set for the whole fan-out, never per checkpoint.
FAN_OUT_FIELDS = frozenset({"tasks", "extra_checkpoints", "random_init_baseline", "deployment",
                            "by_checkpoint"})


class FinetuneConfig(_Model):
    """Stage 5: fine-tuning, one job per task x setting x seed. A setting is one point of the
    grid ``learning_rates`` x ``batch_sizes`` x ``epochs`` (the paper's by default), times
    ``poolings`` and ``layerwise_lr_decays`` when set (unset: ``pooling`` and
    ``layerwise_lr_decay`` alone); the best setting on dev is selected per task.
    ``learning_rate: x`` (likewise ``batch_size``, ``num_train_epochs``) is the one-point grid
    ``[x]``, and reads back when the grid has one point."""

    tasks: list[str] = Field(default_factory=lambda: ["sst2"], description="Registered task names; <task>@<n> is a classification task trained on n of its examples (a learning-curve point).")
    data_dir: str | None = Field(None, description="Folder with one sub-folder of files per task.")
    seeds: list[int] = Field(default_factory=lambda: [1, 2, 3])
    learning_rates: list[float] = Field(
        default_factory=lambda: [5e-5, 3e-5, 2e-5], min_length=1,
        description="Grid of peak learning rates (paper: 5e-5, 3e-5, 2e-5).")
    batch_sizes: list[int] = Field(default_factory=lambda: [16, 32], min_length=1,
                                   description="Grid of batch sizes (paper: 16, 32).")
    epochs: list[float] = Field(default_factory=lambda: [2.0, 3.0, 4.0], min_length=1,
                                description="Grid of training epochs (paper: 2, 3, 4).")
    warmup_proportion: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0)
    pooling: Literal["cls", "mean"] = Field(
        "cls", json_schema_extra=VERSIONED_WHEN_SET, description="What a sequence-level head reads: the paper's pooler over [CLS], or the "
        "mean of the last layer's token states (a [CLS] that masked-LM-only pre-training never trains "
        "carries little of the sentence).")
    reinit_layers: int = Field(0, ge=0, json_schema_extra=VERSIONED_WHEN_SET, description="Top encoder layers given a fresh init before "
                               "fine-tuning (Zhang et al. 2021).")
    layerwise_lr_decay: float = Field(1.0, gt=0, le=1, json_schema_extra=VERSIONED_WHEN_SET, description="Each layer below the top trains at "
                                      "this factor of the rate of the one above (ELECTRA: 0.8); 1 = off.")
    poolings: list[Literal["cls", "mean"]] | None = Field(
        None, min_length=1, json_schema_extra=VERSIONED_WHEN_SET,
        description="Grid of poolings, e.g. [cls, mean]; None: pooling alone.")
    layerwise_lr_decays: list[float] | None = Field(
        None, min_length=1, json_schema_extra=VERSIONED_WHEN_SET,
        description="Grid of layer-wise decays, e.g. [1.0, 0.8]; None: layerwise_lr_decay alone.")
    max_seq_length: int = Field(128, ge=8, description="For sentence(-pair) tasks, NER and SWAG.")
    # SQuAD
    squad_max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    # execution
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", json_schema_extra=VERSIONED_WHEN_SET, description="cpu, or gpu: the job's model and batches on cuda:<LOCAL_RANK> (0 unless launched)."
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", json_schema_extra=VERSIONED_WHEN_SET, description="bf16: forward and loss under bf16 autocast (fp32 weights and optimizer); "
        "fp32 on a GPU multiplies in TF32."
    )
    deepspeed: bool = Field(False, description="Run each job under DeepSpeed instead of one process.")
    max_train_examples: int | None = Field(None, ge=1, description="Cap for quick runs.")
    save_every_job: bool = Field(
        False, json_schema_extra=VERSIONED_WHEN_SET, description="Keep every job's model folder "
        "(<task>/<setting>/seed=<s>/model), not only the chosen one published as <task>/model; "
        "a bert-base model is about 440 MB a job.")
    submission: bool = Field(
        True, json_schema_extra=VERSIONED_WHEN_SET, description="Write leaderboard files for each task's "
        "chosen model into <task>/submission/: GLUE's test-split TSVs, SQuAD's predictions.json on dev.")
    threads: int = Field(2, ge=1)
    max_parallel_jobs: int = Field(
        1, ge=1, description="Fine-tune jobs running at once in the finetune flow (in its process, "
        "or on the work pool with `deployment`).")
    # fan-out (flows/pipeline.py)
    extra_checkpoints: list[str] = Field(
        default_factory=list, description="Also fine-tune these checkpoints (transformers layout, "
        "e.g. samples/models/minilm), beside the freshly pre-trained one."
    )
    random_init_baseline: bool = Field(
        False, description="Also fine-tune the pre-trained model's architecture and vocab from a "
        "random init (seeded by pretrain.seed): the baseline that shows what pre-training adds."
    )
    deployment: str | None = Field(
        None, description="Send each fine-tune job to this deployment ('flow/deployment') with "
        "run_deployment instead of running it in the pipeline's process."
    )
    by_checkpoint: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Settings that differ for one checkpoint, keyed by its "
        "folder name under finetune/ (pretrained, random-init, or an extra checkpoint's), e.g. "
        "{minilm: {learning_rates: [1e-4], epochs: [1]}}: each model at the grid that suits its size, "
        "in the pipeline's fan-out."
    )

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        problems: list[str] = []
        if self.doc_stride >= self.squad_max_seq_length - self.max_query_length - 3:
            problems.append(
                f"doc_stride={self.doc_stride} must be smaller than the context window "
                f"squad_max_seq_length - max_query_length - 3 = "
                f"{self.squad_max_seq_length - self.max_query_length - 3}"
            )
        if len(set(self.seeds)) != len(self.seeds):
            problems.append(f"finetune.seeds has repeats: {self.seeds}")
        for name in ("learning_rates", "batch_sizes", "epochs"):
            grid = getattr(self, name)
            if any(v <= 0 for v in grid) or len(set(grid)) != len(grid):
                problems.append(f"finetune.{name}={grid}: give distinct values above 0")
        if self.layerwise_lr_decays and not all(0 < v <= 1 for v in self.layerwise_lr_decays):
            problems.append(f"finetune.layerwise_lr_decays={self.layerwise_lr_decays}: give values in (0, 1]")
        for one, grid in (("pooling", "poolings"), ("layerwise_lr_decay", "layerwise_lr_decays")):
            values = getattr(self, grid)
            if values is not None and len(set(values)) != len(values):
                problems.append(f"finetune.{grid}={values}: give distinct values")
            if values is not None and getattr(self, one) != type(self).model_fields[one].default:
                problems.append(f"finetune.{one} and finetune.{grid} are both set: set the one value "
                                "or the grid")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_by_checkpoint(self) -> FinetuneConfig:
        for name, settings in self.by_checkpoint.items():
            fan_out = sorted(set(settings) & FAN_OUT_FIELDS)
            if fan_out:
                raise ValueError(f"finetune.by_checkpoint.{name} sets {', '.join(fan_out)}: that is "
                                 "fan-out for every checkpoint; set it in finetune itself")
            self.for_checkpoint(name)  # the merged settings validate as a whole
        return self

    def for_checkpoint(self, name: str) -> FinetuneConfig:
        """The settings the checkpoint ``name`` is fine-tuned with: these, with its
        ``by_checkpoint`` entry laid over them."""
        settings = self.by_checkpoint.get(name)
        if not settings:
            return self
        try:
            return FinetuneConfig.model_validate(
                self.model_dump(exclude={"by_checkpoint"}) | settings)
        except ValidationError as err:
            raise ValueError("; ".join(error_lines(err, f"finetune.by_checkpoint.{name}"))) from None

    @model_validator(mode="before")
    @classmethod
    def _one_point_grid(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for one, grid in (("learning_rate", "learning_rates"), ("batch_size", "batch_sizes"),
                              ("num_train_epochs", "epochs")):
                if one in data:
                    data[grid] = [data.pop(one)]
        return data

    def _single(self, grid: str) -> Any:
        values = getattr(self, grid)
        if len(values) != 1:
            raise ValueError(f"finetune.{grid}={values} is a grid; one job runs one setting "
                             "(FinetuneConfig.at)")
        return values[0]

    @property
    def learning_rate(self) -> float:
        return self._single("learning_rates")

    @property
    def batch_size(self) -> int:
        return self._single("batch_sizes")

    @property
    def num_train_epochs(self) -> float:
        return self._single("epochs")

    def grid(self) -> list[tuple[float, int, float, str, float]]:
        """Every setting ``(learning_rate, batch_size, num_train_epochs, pooling,
        layerwise_lr_decay)``, in the lists' order (the later a field, the faster it turns)."""
        return [(lr, bs, ep, pool, decay) for bs in self.batch_sizes for lr in self.learning_rates
                for ep in self.epochs for pool in (self.poolings or [self.pooling])
                for decay in (self.layerwise_lr_decays or [self.layerwise_lr_decay])]

    def at(self, learning_rate: float, batch_size: int, num_train_epochs: float, pooling: str,
           layerwise_lr_decay: float) -> FinetuneConfig:
        """This config reduced to one setting (one point of :meth:`grid`): what one job runs with."""
        return self.model_copy(update={"learning_rates": [learning_rate], "batch_sizes": [batch_size],
                                       "epochs": [num_train_epochs], "pooling": pooling, "poolings": None,
                                       "layerwise_lr_decay": layerwise_lr_decay, "layerwise_lr_decays": None})


# --------------------------------------------------------------------------- refresh


class RefreshConfig(_Model):
    """The scheduled refresh: a newer dump -> pre-training continued from the current model ->
    the evaluation suite -> the gate against the current model -> promotion."""

    lang: str = Field("en", min_length=2, description="Wikipedia language of the refreshed dump.")
    vocab: Literal["keep", "retrain"] = Field(
        "keep", description="keep: the current model's vocab (versions stay comparable); retrain: a "
        "new vocab from the new corpus, which starts a new model line (from scratch).")
    init: Literal["continue", "scratch"] = Field(
        "continue", description="continue: start from the current model's weights; scratch: a random init.")
    max_steps: int = Field(200, ge=1, description="The budget of a continued run: optimizer steps, "
                           "one phase at the first phase's sequence length and batch.")
    learning_rate: float | None = Field(None, gt=0, description="Peak rate of a continued run, warmed "
                                        "up again from 0; None: the first phase's.")
    warmup_steps: int = Field(10, ge=0, description="Warmup steps of a continued run.")
    min_documents: int = Field(1, ge=1, description="A refreshed corpus with fewer documents is refused.")
    mlm_loss_band: float = Field(0.05, ge=0, description="The gate: held-out masked-LM loss (new eval "
                                 "documents, and the previous dump's) may exceed the current model's by this.")
    finetune_band: float = Field(1.0, ge=0, description="The gate: a fine-tune task's final score (0-100) "
                                 "may fall below the current model's by this plus the larger seed sd.")
    notify_url: str | None = Field(
        None, pattern=r"^https?://\S+$", description="Webhook that the Prefect automation "
        "`bertpipe-refresh-notify` POSTs to when a refresh fails or keeps the current model; None: "
        "no automation. Not part of a version: changing it retrains nothing.")

    @model_validator(mode="after")
    def _check(self) -> RefreshConfig:
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"refresh.warmup_steps={self.warmup_steps} exceeds refresh.max_steps={self.max_steps}")
        return self


# --------------------------------------------------------------------------- pipeline


STORAGE_ROOT = "{storage_root}"  # a setting naming it means the storage root (PipelineConfig)


def _expand(value: Any, root: str) -> Any:
    """``value`` with ``{storage_root}`` replaced by ``root`` in every string it holds."""
    if isinstance(value, str):
        return value.replace(STORAGE_ROOT, root)
    if isinstance(value, dict):
        return {k: _expand(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_expand(v, root) for v in value]
    return value


class PipelineConfig(_Model):
    """The whole DAG: clean -> vocab -> instances -> pre-train -> fine-tune."""

    name: str = Field("bert", description="Run name; runs/<name>/ under the storage root.")
    storage_root: str = Field(
        "./bertpipe-data", description="Local folder or fsspec URL (gs://bucket/prefix) for all outputs. "
        "Any other setting may name {storage_root}: it is replaced by this value when the config is "
        "loaded (e.g. finetune.data_dir: '{storage_root}/tasks'); `config show` prints the result."
    )
    shared_storage: bool = Field(
        False, description="The storage_root (and every local path given to a job) is storage every Beam "
        "worker reaches: NFS, gcsfuse, or one machine. Without it a runner whose workers are other "
        "machines (dask, Dataflow, Flink, Spark) refuses local paths before any work.",
    )
    runs_root: str | None = Field(
        None, description="Local or mounted folder (gcsfuse, NFS) for pre-training run folders: "
        "DeepSpeed saves checkpoints with torch.save to a path. Unset: storage_root, which must then "
        "be local. When set, the pipeline also copies each run's hf/ export to "
        "<storage_root>/models/<version>/, and fine-tuning reads it from there.",
    )
    workers: int = Field(2, ge=1, description="Beam worker processes on the local runner.")
    beam_runner: str = Field(
        "FnApiRunner", description="Beam runner (PipelineOptions --runner): FnApiRunner (local, in process, "
        "the DirectRunner's batch engine, with `workers` processes), dask (a Dask distributed cluster: "
        "--dask_client_address or --dask_scheduler_file in beam_args), DataflowRunner, FlinkRunner, SparkRunner."
    )
    beam_args: list[str] = Field(default_factory=list, description="Extra Beam pipeline options.")
    corpus: CorpusConfig = Field(default_factory=CorpusConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    instances: InstanceConfig = Field(default_factory=InstanceConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    refresh: RefreshConfig = Field(default_factory=RefreshConfig)

    @model_validator(mode="before")
    @classmethod
    def _expand_storage_root(cls, data: Any) -> Any:
        """Every ``{storage_root}`` in a string setting becomes the storage root, once, here."""
        if not isinstance(data, dict):
            return data
        root = data.get("storage_root", cls.model_fields["storage_root"].default)
        if not isinstance(root, str) or STORAGE_ROOT in root:
            return data
        return _expand(data, root.rstrip("/") or root)

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        problems: list[str] = []
        if self.runs_root is not None and "://" in self.runs_root and not self.runs_root.startswith("file://"):
            problems.append(
                f"runs_root={self.runs_root}: DeepSpeed saves checkpoints to a path; give a local "
                "folder or a mount of the bucket (e.g. gcsfuse at /mnt/gcs/PREFIX/runs)"
            )
        lengths = {s.max_seq_length for s in self.instances.lengths}
        for i, p in enumerate(self.pretrain.phases):
            if p.max_seq_length not in lengths:
                problems.append(
                    f"pretrain.phases[{i}].max_seq_length={p.max_seq_length} has no instances; "
                    f"add it to instances.lengths (now {sorted(lengths)})"
                )
        longest = max(lengths)
        if longest > self.model.max_position_embeddings:
            problems.append(
                f"instances.lengths has max_seq_length={longest} but model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; raise max_position_embeddings to >= {longest}"
            )
        if self.model.vocab_size is not None and self.vocab.vocab_file is None:
            if self.model.vocab_size < self.vocab.vocab_size:
                problems.append(
                    f"model.vocab_size={self.model.vocab_size} < vocab.vocab_size="
                    f"{self.vocab.vocab_size}; leave model.vocab_size unset to follow the vocab"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self


# --------------------------------------------------------------------------- loading


def preset_names() -> list[str]:
    files = resources.files("bert_core") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def preset_dict(name: str) -> dict[str, Any]:
    path = resources.files("bert_core") / "presets" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")
    return yaml.safe_load(path.read_text()) or {}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _yaml(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{what}: not valid YAML ({problem}{where})") from None


def apply_set(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (so 3, true, [1,2] work).

    A numeric part indexes a list: ``pretrain.phases.0.max_steps=10``.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. instances.dupe_factor=2")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: the value {raw!r} is not valid YAML; quote it, e.g. "
                          f"--set '{key}=\"{raw}\"' (a list: --set '{key}=[\"{raw}\"]')") from None
    parts = key.split(".")
    data = json.loads(json.dumps(data))  # deep copy
    node: Any = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the config"
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(f"--set {key}: {here} is a list; name an item by its number, "
                                  f"e.g. {here}.0")
            if int(part) >= len(node):
                raise ConfigError(f"--set {key}: {here} has {len(node)} item(s) (0..{len(node) - 1}); "
                                  f"add items by setting the whole list, e.g. --set '{here}=[...]'")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if part not in node or node[part] is None:
                    node[part] = [] if parts[depth + 1].isdigit() else {}
                node = node[part]
        else:
            raise ConfigError(f"--set {key}: {here} is a single value ({node!r}), it has no field "
                              f"{part!r}; set {here}=VALUE instead")
    return data


def load_config(
    preset: str | None = "demo",
    config_file: str | Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
) -> PipelineConfig:
    """Preset, then a YAML file of the same shape, then ``--set`` overrides; validated once."""
    data: dict[str, Any] = preset_dict(preset) if preset else {}
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = _yaml(path.read_text(), f"config file {path}") or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level is a {type(loaded).__name__}; it must "
                              "be a mapping of sections (corpus:, vocab:, instances:, ...) like a preset")
        data = _deep_merge(data, loaded)
    for assignment in sets:
        data = apply_set(data, assignment)
    return validate(data, source=preset or str(config_file) or "config")


def validate(data: dict[str, Any], source: str = "config", model: type[BaseModel] | None = None) -> Any:
    """The typed config (``model``, default the whole PipelineConfig), or a ConfigError of one
    line naming every invalid field and why."""
    lines: list[str] = []
    while True:
        try:
            typed = (model or PipelineConfig).model_validate(data)
        except ValidationError as err:
            lines += [line for line in error_lines(err) if line not in lines]
            unknown = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
            if not unknown:
                break
            # An unknown key does nothing, so the config without it is still the user's: checking
            # it again finds the errors that the section's own checks report only once its keys are known.
            data = _without(data, unknown)
            continue
        if not lines:
            return typed
        break
    raise ConfigError(f"invalid {source}: " + "; ".join(lines))


def _without(data: Any, locs: list[tuple]) -> Any:
    """``data`` (a deep copy) without the keys at ``locs``."""
    data = json.loads(json.dumps(data, default=str))
    for loc in locs:
        node = data
        for part in loc[:-1]:
            node = node[part]
        node.pop(loc[-1], None)
    return data


def error_lines(err: ValidationError, *prefix: str) -> list[str]:
    """``field.path: why`` for each error of a validation, the path under ``prefix``; an unknown
    key says which known keys it may have meant."""
    model = err.title and _MODELS.get(err.title)
    lines = []
    for e in err.errors():
        path = ".".join([*prefix, *map(str, e["loc"])]) or "(top level)"
        why = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and model is not None:
            why = unknown_key_hint(model, e["loc"], prefix)
        lines.append(f"{path}: {why}")
    return lines


def _fields_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The config model that holds the last key of ``loc`` (list items and dict values followed)."""
    import typing

    here: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(here, type) and issubclass(here, BaseModel)):
            continue
        field = here.model_fields.get(part)
        if field is None:
            return None
        here = field.annotation
        while typing.get_origin(here) is not None:  # list[X], dict[str, X], X | None -> X
            args = [a for a in typing.get_args(here) if a is not type(None)]
            here = args[-1] if args else None
    return here if isinstance(here, type) and issubclass(here, BaseModel) else None


def unknown_key_hint(model: type[BaseModel], loc: tuple, prefix: tuple[str, ...] = ()) -> str:
    """"unknown key; did you mean vocab.vocab_size?" for a key no config model has at ``loc``:
    close spellings at that level first, then the same name in another section."""
    import difflib

    key, where = str(loc[-1]), ".".join([*prefix, *map(str, loc[:-1])])
    holder = _fields_at(model, loc)
    if holder is None:
        return "unknown key"
    known = list(holder.model_fields)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    close += [k for k in known if k not in close and len(key) >= 3 and (key in k or k in key)]
    close += [k for k in known if k not in close and key == "".join(w[0] for w in k.split("_"))]  # lr
    if close:
        return "unknown key; did you mean " + " or ".join(f"{where + '.' if where else ''}{k}" for k in close[:3]) + "?"
    elsewhere = [f"{name}.{key}" for name, field in PipelineConfig.model_fields.items()
                 if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
                 and key in field.annotation.model_fields]
    if elsewhere:
        return f"unknown key here; did you mean {' or '.join(elsewhere)}?"
    return f"unknown key; {where or 'the config'} has: {', '.join(known)}"


_MODELS: dict[str, type[BaseModel]] = {}  # filled below: every config model by its class name


def versioned(config: BaseModel, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A config as a version sees it: without ``exclude`` and without the VERSIONED_WHEN_SET
    fields left at their default."""
    unset = {name for name, field in type(config).model_fields.items()
             if field.json_schema_extra == VERSIONED_WHEN_SET
             and getattr(config, name) == field.get_default(call_default_factory=True)}
    return config.model_dump(mode="json", exclude=unset | exclude)


def config_hash(*parts: Any) -> str:
    """Short stable hash of configs and input manifests: the `<version>` of a stage's output."""
    blob = json.dumps(
        [versioned(p) if isinstance(p, BaseModel) else p for p in parts],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


_MODELS.update({m.__name__: m for m in _Model.__subclasses__()})
