"""The recipe choice: which candidate recipe (the protocol's ``candidates``) buys the most
few-label gain for its CPU-minutes. Three steps, the last two on whatever accelerator there is
(``make gpu-quality`` and ``gpu-quality-evaluate`` run them on the device machine, from the stage):

    python -m benchmarks.quality prepare --protocol v2 --work W --stage .search-v2            # here
    python -m benchmarks.quality pretrain --protocol v2 --candidates --stage .search-v2 --out OUT --seeds 42,43
    python -m benchmarks.quality choose --protocol v2 --work W --checkpoints OUT --choose FILE

The steps: :func:`prepare`, :func:`pretrain_all`, :func:`evaluate`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.quality import build
from benchmarks.quality import corpus as quality_corpus
from benchmarks.quality import tasks as qt
from benchmarks.quality.cache import Cache, pack_cache, run_cached, weights_digest
from benchmarks.quality.spec import CHOSEN, RECIPES, ROOT, Recipe, candidates, protocol, versions
from bert_core.config import PretrainConfig

BUDGET_MINUTES = 60.0
ARCHIVE_PART = 15 * 2**20  # the archive of checkpoints comes back in parts of this many bytes
TIMING_SECONDS = 30.0  # --gpu-minutes: how long the runs are timed side by side
XZ_PRESET = 6  # compression of the checkpoints' trip back (lossless at any preset)
TIMING_WARMUP = 10  # steps each run takes before the timing starts (allocations, kernel choice)
STAGE_LIMIT = 56 * 2**20  # what a device call carries (64 MiB) less the tree and the wheels beside the stage
RETURN_LIMIT = 64 * 2**20  # what comes back from a device call's $OUT, in at most 8 files
RETURN_ROOM = 2**20  # of RETURN_LIMIT, what the logs beside the checkpoints' archive may take
STAGE_SAMPLES = "samples"  # the stage's copy of the tasks' files, at their paths under the samples folder
TIMING_ROUNDS = 3  # prepare: each cost is timed this many times, the costs in turn, and the median kept

CANDIDATE_SETS = {v: candidates(v) for v in versions()}
CANDIDATES_V2 = CANDIDATE_SETS["v2"]
ALL_RECIPES = {n: r for recipes in CANDIDATE_SETS.values() for n, r in recipes.items()}
CHOSEN_ON_K1 = RECIPES["chosen-on-k1"]
GRID = protocol("v2")["grid"]


def recipe_names(text: str) -> list[str]:
    """``--recipes``: a version (``v2``) for its candidates, else candidates' names, comma-separated."""
    names = [n for part in text.split(",") if part.strip()
             for n in (CANDIDATE_SETS[part.strip()] if part.strip() in CANDIDATE_SETS else [part.strip()])]
    unknown = [n for n in names if n not in ALL_RECIPES]
    if unknown or not names:
        raise SystemExit(f"--recipes {text}: unknown recipe {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join([*CANDIDATE_SETS, *ALL_RECIPES])}")
    return names


def model_for(variant: Recipe, vocab_size: int, seed: int = 42):
    """The variant's model from the product's random init for ``seed``."""
    from bert_core.pretrain.in_process import random_init

    return random_init(model_config_for(variant, vocab_size), seed)


def model_config_for(recipe: Recipe, vocab_size: int):
    """The search's model config of ``recipe``: pre-LN at 512 positions, the same for every
    candidate, since fine-tuning is at 64 tokens whatever the pre-training length."""
    from bert_core.config import ModelConfig

    return ModelConfig(size=recipe.size, vocab_size=vocab_size, max_position_embeddings=512, pre_layer_norm=True)


def train(variant: Recipe, model, instances: str, steps: int, seed: int, device: str = "cpu", **kwargs) -> list[dict]:
    """The product's in-process masked-LM steps at the variant's settings: ``batch`` sequences of
    ``seq`` tokens a step, the instances' dynamic masks drawn with the variant's share of pieces
    (whole words with ``whole_word_mask``, as the loader masks for ``instances.whole_word_mask``)."""
    config = short_run(variant.seq, steps, variant.batch, variant.learning_rate, variant.weight_decay, seed)
    masking = {"masked_lm_prob": variant.masked_lm_prob, "whole_word_mask": variant.whole_word_mask}
    return train_mlm(model, instances, config, device=device, masking=masking, **kwargs)


def train_mlm(model: Any, instances: str, config: PretrainConfig, phase_index: int = 0, device: str = "cpu",
              masking: dict[str, Any] | None = None, log_every: int = 500,
              on_step: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """The phase's ``max_steps`` optimizer steps on ``instances`` in this process: batches of its
    ``global_batch_size`` at its length, AdamW with the config's betas, epsilon and weight decay
    (matrices only), linear warmup then linear decay, gradient clipping; ``masking`` overrides
    fields of the instances' dynamic masking. The loss and masked-LM accuracy every ``log_every``
    steps and at the last."""
    import torch

    from bert_core.model.schedule import linear_warmup_decay
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.data import PretrainingLoader, to_device

    phase = config.phases[phase_index]
    model.to(device).train()
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=phase.learning_rate,
                                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(phase.warmup_steps, phase.max_steps))
    loader = PretrainingLoader(instances, max_seq_length=phase.max_seq_length,
                               micro_batch_size=phase.global_batch_size, seed=config.seed + phase_index)
    if masking:
        loader.masking = replace(loader.masking, **masking)
    batches = iter(loader)
    log = []
    for step in range(phase.max_steps):
        result = model(**to_device(next(batches), device))
        result["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step:
            on_step(step)
        if step % log_every == 0 or step == phase.max_steps - 1:
            log.append({"step": step, "loss": float(result["mlm_loss"]), "mlm_acc": float(result["mlm_acc"])})
    return log


def short_run(max_seq_length: int, steps: int, batch_size: int, learning_rate: float, weight_decay: float,
              seed: int) -> PretrainConfig:
    """One phase of ``steps`` at ``max_seq_length``, ``batch_size`` sequences a step, warmup over
    a tenth of the steps: the config :func:`train_mlm` reads for a short run."""
    from bert_core.config import PretrainPhase

    phase = PretrainPhase(max_seq_length=max_seq_length, max_steps=steps, global_batch_size=batch_size,
                          micro_batch_size=batch_size, learning_rate=learning_rate,
                          warmup_steps=max(1, steps // 10))
    return PretrainConfig(phases=[phase], procs_per_node=1, weight_decay=weight_decay, seed=seed)


# --------------------------------------------------------------------------- prepare (here)


def cpu_seconds_per_step(variant: Recipe, instances: str, vocab_size: int, warmup: int = 5, timed: int = 30) -> float:
    """CPU seconds a step of ``variant`` costs on this machine, one thread, after ``warmup`` steps."""
    import torch

    torch.set_num_threads(1)
    marks: dict[int, float] = {}
    train(variant, model_for(variant, vocab_size, seed=0), instances, warmup + timed, 0, log_every=10**9,
          on_step=lambda s: marks.setdefault(s, time.process_time()))
    return (marks[warmup + timed - 1] - marks[warmup - 1]) / timed


def corpus_for(name: str, work: Path, samples: Path) -> tuple[Path, Path]:
    """Corpus ``name`` (``k1``, ``k2``) and its vocab, built once under ``work/name`` by
    ``corpus`` (with the chosen recipe's instances beside them); stops when a
    dev or test text of a task is in it."""

    if name not in quality_corpus.CORPORA:
        raise SystemExit(f"corpus {name}: not one of {', '.join(quality_corpus.CORPORA)}")
    tasks = {n: qt.load(t, samples) for n, t in qt.TASKS.items()}
    built = quality_corpus.build(name, RECIPES[CHOSEN], work, samples, tasks)
    return built.corpus, built.vocab


def cost_key(variant: Recipe) -> tuple:
    """What decides a step's cost: variants equal in it (they differ in optimizer settings only)
    share one timing."""
    return (variant.corpus, variant.size, variant.seq, variant.batch, variant.masked_lm_prob, variant.whole_word_mask)


def stage_instances_name(corpus: str, seq: int) -> str:
    return f"instances-{corpus}-seq{seq}"


def stage_tasks(samples: Path, stage: Path) -> list[Path]:
    """Every file that ``quality_qt.TASKS`` pins, checked against its pin and copied from
    ``samples`` to the same path under ``stage/samples``: what ``tasks.load`` reads on a
    machine without the samples (it checks the pins again there)."""

    copied = []
    for task in qt.TASKS.values():
        qt.check_pins(task, samples)
        for rel in task.files:
            target = stage / STAGE_SAMPLES / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(samples / rel, target)
            copied.append(target)
    return copied


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def write_plan(plan: dict, stage: Path, work: Path) -> None:
    """The plan as ``stage/steps.json`` and ``work/search-v2/plan.json``."""
    (stage / "steps.json").write_text(json.dumps(plan, indent=1))
    (work / "search-v2").mkdir(parents=True, exist_ok=True)
    (work / "search-v2" / "plan.json").write_text(json.dumps(plan, indent=1))


def restage_tasks(work: Path, stage: Path, samples: Path) -> dict:
    """The tasks' files (:func:`stage_tasks`) added to a version-2 stage already prepared, its
    plan's ``stage_bytes`` updated."""
    if not (stage / "steps.json").exists():
        raise SystemExit(f"{stage}/steps.json is missing: run benchmarks.quality prepare --stage {stage}")
    plan = json.loads((stage / "steps.json").read_text())
    if plan.get("candidates") != "v2":
        raise SystemExit(f"{stage} is not a candidates' stage (benchmarks.quality prepare writes one)")
    stage_tasks(samples, stage)
    plan["stage_bytes"] = folder_bytes(stage)
    write_plan(plan, stage, work)
    return plan


def prepare(work: Path, stage: Path, samples: Path, chosen_steps: int, corpora: list[str]) -> dict:
    """Per candidate of ``corpora``, its corpus's vocab and instances at its length,
    and its step count, the protocol's ``chosen_steps`` for the chosen recipe (on K1) scaled by
    that recipe's CPU-seconds a step over the candidate's (timed here in-process on one thread,
    per :func:`cost_key`, the median of :data:`TIMING_ROUNDS` timings taken in turn). The corpora
    come from :func:`corpus_for`. Writes ``stage`` (each corpus's vocab folder, its instances
    packed by :func:`pack_instances`, the tasks' files by :func:`stage_tasks` and ``steps.json``)
    and the same plan to ``work/search-v2/plan.json``."""
    from bert_core.pretrain.data import read_vocab, vocab_file_of

    names = [n for n, v in CANDIDATES_V2.items() if v.corpus in corpora]
    if not names:
        raise SystemExit(f"--corpus {','.join(corpora)}: no candidate of version 2 uses it (k1, k2)")
    built = {corpus: corpus_for(corpus, work, samples) for corpus in sorted({"k1", *(CANDIDATES_V2[n].corpus
                                                                                   for n in names)})}
    base = RECIPES[CHOSEN]
    local: dict[tuple[str, int], Path] = {}
    for corpus, seq in sorted({("k1", 64), *((CANDIDATES_V2[n].corpus, CANDIDATES_V2[n].seq) for n in names)}):
        corpus_dir, vocab_dir = built[corpus]
        local[corpus, seq] = build.instances_for(replace(base, seq=seq), corpus_dir, vocab_dir, work / corpus)
    timed_variants = {"chosen": CHOSEN_ON_K1, **{n: CANDIDATES_V2[n] for n in names}}
    groups: dict[tuple, tuple[str, Recipe]] = {}
    for name, variant in timed_variants.items():
        groups.setdefault(cost_key(variant), (name, variant))
    rounds: dict[tuple, list[float]] = {key: [] for key in groups}
    for r in range(TIMING_ROUNDS):  # in turn, so that the machine's load drifts over every cost alike
        for key, (name, variant) in groups.items():
            instances = str(local[variant.corpus, variant.seq])
            started = time.perf_counter()
            rounds[key].append(cpu_seconds_per_step(variant, instances, len(read_vocab(vocab_file_of(instances))),
                                                    timed=20))
            print(f"timed {name} (round {r + 1}): {rounds[key][-1]:.3f} CPU-s a step "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    members = {n: cost_key(v) for n, v in timed_variants.items()}
    costs = {n: statistics.median(rounds[key]) for n, key in members.items()}
    timings = {groups[key][0]: {"rounds": rounds[key], "for": [n for n, k in members.items() if k == key]}
               for key in groups}
    steps = {n: round(chosen_steps * costs["chosen"] / costs[n]) for n in names}
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    archives, vocabs = {}, {}
    for corpus in sorted({CANDIDATES_V2[n].corpus for n in names}):
        vocabs[corpus] = vocab_file_of(str(local[corpus, 64 if (corpus, 64) in local else 128]))
        shutil.copytree(Path(vocabs[corpus]).parent, stage / f"vocab-{corpus}")
        folders = {stage_instances_name(c, s): f for (c, s), f in local.items()
                   if c == corpus and any(CANDIDATES_V2[n].corpus == c and CANDIDATES_V2[n].seq == s for n in names)}
        started = time.perf_counter()
        packed = pack_instances(folders, stage, f"instances-{corpus}.npz.xz")
        archives[corpus] = hashlib.sha256(packed.read_bytes()).hexdigest()
        print(f"packed {', '.join(folders)}: {packed.stat().st_size / 2**20:.1f} MiB "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    stage_tasks(samples, stage)
    size = folder_bytes(stage)
    plan = {"candidates": "v2", "chosen_steps": chosen_steps, "cpu_seconds_per_step": costs, "timings": timings,
            "steps": steps,
            "corpus": {n: CANDIDATES_V2[n].corpus for n in names},
            "instances": {n: stage_instances_name(CANDIDATES_V2[n].corpus, CANDIDATES_V2[n].seq) for n in names},
            "vocabs": vocabs, "archives": archives, "stage_bytes": size,
            "budget_cpu_minutes": {n: BUDGET_MINUTES for n in names}}
    write_plan(plan, stage, work)
    print(f"stage {stage}: {size / 2**20:.1f} MiB"
          + ("" if size <= STAGE_LIMIT else f", over the {STAGE_LIMIT / 2**20:.0f} MiB a device call has room for"))
    return plan


# --------------------------------------------------------------------------- the stage's compact instances


def _narrow(values):
    import numpy as np

    if values.dtype.kind in "iu" and len(values) and values.min() >= 0:
        for dtype in (np.uint8, np.uint16):
            if values.max() <= np.iinfo(dtype).max:
                return values.astype(dtype)
    return values


def pack_instances(folders: dict[str, Path], into: Path, archive_name: str) -> Path:
    """Instances folders (stage name -> folder) as ``into/NAME/`` with every file but the
    training shards of ``seq*/``, and those shards' columns, in narrow integer types, as one xz
    stream ``into/archive_name`` whose dictionary spans all of it: the instances of two lengths
    and of the corpus's copies (``dupe_factor``) repeat the same runs of ids, which xz then
    stores once. :func:`unpack_instances` writes the shards back, row for row."""
    import lzma

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays: dict[str, np.ndarray] = {}
    for name, folder in folders.items():
        def shards(directory: str, entries: list[str], folder: Path = folder) -> list[str]:
            inside = Path(directory).parent == folder and Path(directory).name.startswith("seq")
            return [e for e in entries if inside and e.endswith(".parquet")]

        shutil.copytree(folder, into / name, ignore=shards)
        for seq_dir in sorted(p for p in folder.glob("seq*") if p.is_dir()):
            for entry in json.loads((seq_dir / "_MANIFEST.json").read_text())["shards"]:
                table = pq.read_table(seq_dir / entry["path"])
                key = f"{name}|{seq_dir.name}|{entry['path']}"
                arrays[f"{key}|schema"] = np.frombuffer(table.schema.serialize().to_pybytes(), dtype=np.uint8)
                for column_name in table.column_names:
                    column = table.column(column_name).combine_chunks()
                    if column.null_count:
                        raise SystemExit(f"{seq_dir / entry['path']}: column {column_name} has nulls; re-run the "
                                         "instances stage")
                    if pa.types.is_list(column.type):
                        offsets = column.offsets.to_numpy()
                        values = column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
                        arrays[f"{key}|{column_name}|lengths"] = _narrow(np.diff(offsets))
                        arrays[f"{key}|{column_name}|values"] = _narrow(values)
                    else:
                        arrays[f"{key}|{column_name}"] = column.to_numpy(zero_copy_only=False)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    raw = buffer.getvalue()
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9, "dict_size": min(max(len(raw), 2**20), 2**30)}]
    archive = into / archive_name
    archive.write_bytes(lzma.compress(raw, format=lzma.FORMAT_XZ, filters=filters))
    return archive


def unpack_instances(stage: Path, archive_name: str, into: Path, vocab_files: dict[str, str]) -> None:
    """The instances folders of a :func:`pack_instances` archive under ``into``, their training
    shards written back from it, each folder's manifest naming ``vocab_files[name]`` (the stage's
    copy of the vocab the ids index: the path recorded here means nothing on another machine).
    The shards' bytes differ from the originals (the manifests' shard sha256s do not hold); their
    rows do not."""
    import lzma

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = np.load(io.BytesIO(lzma.decompress((stage / archive_name).read_bytes())))
    shard_keys = sorted({k.rsplit("|", 1)[0] for k in data.files if k.endswith("|schema")})
    for name in sorted({k.split("|")[0] for k in shard_keys}):
        shutil.rmtree(into / name, ignore_errors=True)
        shutil.copytree(stage / name, into / name)
        manifest = json.loads((into / name / "_MANIFEST.json").read_text())
        manifest["vocab_file"] = str(Path(vocab_files[name]).resolve())
        (into / name / "_MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    for key in shard_keys:
        name, seq, path = key.split("|")
        schema = pa.ipc.read_schema(pa.py_buffer(data[f"{key}|schema"].tobytes()))
        columns = []
        for field in schema:
            if pa.types.is_list(field.type):
                offsets = np.zeros(len(data[f"{key}|{field.name}|lengths"]) + 1, dtype=np.int32)
                np.cumsum(data[f"{key}|{field.name}|lengths"], out=offsets[1:])
                values = pa.array(data[f"{key}|{field.name}|values"]).cast(field.type.value_type)
                columns.append(pa.ListArray.from_arrays(pa.array(offsets), values).cast(field.type))
            else:
                columns.append(pa.array(data[f"{key}|{field.name}"]).cast(field.type))
        pq.write_table(pa.Table.from_arrays(columns, schema=schema), into / name / seq / path, compression="zstd")


def staged_inputs(stage: Path, plan: dict, unpack_root: Path | None = None) -> dict[str, tuple[str, str]]:
    """Per recipe of the stage's plan: the instances it reads and their vocab file, the stage's
    instances unpacked once under ``unpack_root`` (default: the system's temporary folder, never
    the stage, which travels to the device machine whole)."""
    if plan.get("candidates") != "v2":
        raise SystemExit(f"{stage} is not a candidates' stage (benchmarks.quality prepare writes one)")
    root = unpack_root or Path(tempfile.gettempdir())
    out = {}
    for corpus, digest in plan["archives"].items():
        into = root / f"quality-search-{digest[:16]}"
        names = sorted({plan["instances"][n] for n, c in plan["corpus"].items() if c == corpus})
        vocab_file = str(stage / f"vocab-{corpus}" / "vocab.txt")
        if not (into / "unpacked.json").exists():
            shutil.rmtree(into, ignore_errors=True)
            into.mkdir(parents=True)
            unpack_instances(stage, f"instances-{corpus}.npz.xz", into, dict.fromkeys(names, vocab_file))
            (into / "unpacked.json").write_text(json.dumps(names))
        for n, c in plan["corpus"].items():
            if c == corpus:
                out[n] = (str(into / plan["instances"][n]), vocab_file)
    return out


# --------------------------------------------------------------------------- the checkpoints' trip back


def compact_checkpoint(folder: Path) -> None:
    """A saved checkpoint made small for the trip back, losslessly: ``model.safetensors`` with its
    data as byte planes (byte 0 of every 4 first, ...: float32 exponents, alike from value to
    value, then compress well), xz-compressed, and the vocab and tokenizer xz-compressed.
    :func:`expand_checkpoint` restores every file byte for byte."""
    import lzma

    import numpy as np

    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: header length, header, data
    body = np.frombuffer(data, dtype=np.uint8, offset=start)
    whole = len(body) // 4 * 4
    planes = body[:whole].reshape(-1, 4).T.tobytes() + body[whole:].tobytes()
    (folder / "model.safetensors.planes.xz").write_bytes(lzma.compress(data[:start] + planes, preset=XZ_PRESET))
    weights.unlink()
    for name in ("vocab.txt", "tokenizer.json"):
        if (folder / name).exists():
            (folder / f"{name}.xz").write_bytes(lzma.compress((folder / name).read_bytes(), preset=XZ_PRESET))
            (folder / name).unlink()


def expand_checkpoint(folder: Path) -> None:
    """The files of a :func:`compact_checkpoint` folder as they were saved."""
    import lzma

    import numpy as np

    packed = folder / "model.safetensors.planes.xz"
    if packed.exists():
        data = lzma.decompress(packed.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        body = np.frombuffer(data, dtype=np.uint8, offset=start)
        whole = len(body) // 4 * 4
        restored = body[:whole].reshape(4, -1).T.tobytes() + body[whole:].tobytes()
        (folder / "model.safetensors").write_bytes(data[:start] + restored)
        packed.unlink()
    for name in ("vocab.txt", "tokenizer.json"):
        if (folder / f"{name}.xz").exists():
            (folder / name).write_bytes(lzma.decompress((folder / f"{name}.xz").read_bytes()))
            (folder / f"{name}.xz").unlink()


def archive(out: Path, name: str, folders: Path, members: list[str]) -> list[Path]:
    """``members`` of ``folders`` as ``out/NAME.tar`` (paths ``checkpoints/MEMBER/...``), split
    into parts ``NAME.tar.part-NN`` when larger than :data:`ARCHIVE_PART`; the files written."""
    whole = out / f"{name}.tar"
    with tarfile.open(whole, "w") as tar:
        for member in members:
            tar.add(folders / member, arcname=f"checkpoints/{member}")
            shutil.rmtree(folders / member)
    if whole.stat().st_size <= ARCHIVE_PART:
        return [whole]
    subprocess.run(["split", "-b", str(ARCHIVE_PART), "-d", whole.name, f"{whole.name}.part-"], cwd=out, check=True)
    whole.unlink()
    return sorted(out.glob(f"{name}.tar.part-*"))


# --------------------------------------------------------------------------- pretrain (on the GPU)


class _TimingDone(Exception):
    """Ends a timing run from its step callback."""


def _device(threads: int | None) -> str:
    import torch

    if threads:
        torch.set_num_threads(threads)
    return "cuda" if torch.cuda.is_available() else "cpu"


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_one(name: str, instances: str, vocab_file: str, seed: int, seconds: float, barrier,
             threads: int | None = None) -> dict:
    """Steps a second of one run while every run is timed side by side: :data:`TIMING_WARMUP`
    steps, then all runs wait for each other at ``barrier``, then ``seconds`` of steps. The
    model is thrown away; its run starts again from its random init."""
    from bert_core.pretrain.data import read_vocab

    variant = ALL_RECIPES[name]
    device = _device(threads)
    model = model_for(variant, len(read_vocab(vocab_file)), seed)
    marks: dict[str, float] = {}

    def on_step(step: int) -> None:
        if step == TIMING_WARMUP - 1:
            _synchronize(device)
            barrier.wait(timeout=300)
            marks["start"] = time.perf_counter()
        elif step >= TIMING_WARMUP and time.perf_counter() - marks["start"] >= seconds:
            _synchronize(device)
            marks["seconds"] = time.perf_counter() - marks["start"]
            marks["steps"] = step - TIMING_WARMUP + 1
            raise _TimingDone

    try:
        train(variant, model, instances, 10**9, seed, device, log_every=10**9, on_step=on_step)
    except _TimingDone:
        pass
    except BaseException:
        barrier.abort()  # the other runs stop waiting for this one
        raise
    return {"recipe": name, "seed": seed, "steps": int(marks["steps"]), "seconds": marks["seconds"],
            "steps_per_second": marks["steps"] / marks["seconds"]}


def pretrain_one(stage: str, name: str, steps: int, out: str, seed: int = 42, folder: str | None = None,
                 inputs: tuple[str, str] | None = None, threads: int | None = None, extra: dict | None = None,
                 compact: bool = False) -> dict:
    """One recipe for ``steps`` from its random init for ``seed``, saved under ``out/folder``
    (default ``out/name``; :func:`compact_checkpoint` with ``compact``) with ``pretrain-log.json``:
    card, steps, tokens seen (steps x batch x length), wall-clock minutes of the steps, the loss
    log and ``extra``. The folder appears whole (written beside it, then renamed), so a folder
    with its log is a finished run."""
    import torch

    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab

    variant = ALL_RECIPES[name]
    stage_dir = Path(stage)
    if inputs is None:
        inputs = staged_inputs(stage_dir, json.loads((stage_dir / "steps.json").read_text()))[name]
    instances, vocab_file = inputs
    device = _device(threads if threads else 2 if torch.cuda.is_available() else None)
    model = model_for(variant, len(read_vocab(vocab_file)), seed)
    started = time.perf_counter()
    log = train(variant, model, instances, steps, seed, device)
    _synchronize(device)
    wall = (time.perf_counter() - started) / 60
    target = Path(out) / (folder or name)
    part = target.with_name(f"{target.name}.part")
    shutil.rmtree(part, ignore_errors=True)
    save_pretrained(model.cpu(), str(part), vocab_file=vocab_file)
    row = {"recipe": name, "seed": seed, "folder": target.name, "steps": steps, "device": device,
           "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "batch": variant.batch, "seq": variant.seq, "tokens_seen": steps * variant.batch * variant.seq,
           "wall_minutes": wall, **(extra or {}), "log": log}
    (part / "pretrain-log.json").write_text(json.dumps(row))
    if compact:
        compact_checkpoint(part)
    shutil.rmtree(target, ignore_errors=True)
    part.rename(target)
    return row


def gpu_minute_steps(rates: list[float], minutes: float) -> int:
    """One step count for every run: the slowest run's steps a second over ``minutes`` (so no run
    trains longer than its minutes when all run side by side), at least 1."""
    return max(1, math.floor(min(rates) * 60 * minutes))


def pretrain_all(stage: Path, out: Path, names: list[str], scale: float = 1.0, seeds: list[int] | None = None,
                 gpu_minutes: float | None = None, timing_seconds: float = TIMING_SECONDS,
                 unpack_root: Path | None = None, keep: Path | None = None) -> int:
    """Every recipe side by side, one process each, for the stage's step count of the recipe
    (times ``scale``), or with ``gpu_minutes`` for one count for all, :func:`gpu_minute_steps` of
    a :func:`time_one` of them all side by side (the learning-rate schedule is that count's).
    Every recipe x seed runs in a folder ``<recipe>-seed<S>``, each made compact
    (:func:`compact_checkpoint`) and all of them archived together at the end as ``runs.tar`` or
    its parts: a device call returns at most 8 files. A run that fails is reported and left out;
    the others are archived and the status is 1.

    With ``keep``, the runs stay in ``keep`` as saved (what ``evaluate`` reads on
    the same machine), a run already there is not run again, every run's log goes to
    ``out/pretrain-logs.json`` and the compact archive of them all to ``out`` only when it fits
    in what a device call returns (:func:`archive_runs`)."""
    if not (stage / "steps.json").exists():
        raise SystemExit(f"{stage}/steps.json is missing: run benchmarks.quality prepare --stage {stage} first")
    plan = json.loads((stage / "steps.json").read_text())
    missing = [n for n in names if n not in plan["steps"]]
    if missing:
        raise SystemExit(f"{stage} was prepared without {', '.join(missing)} (it has {', '.join(plan['steps'])}); "
                         "prepare it with the candidates you pre-train")
    if not seeds:
        raise SystemExit("pretrain needs --seeds: its runs are the folders <recipe>-seed<S>")
    every = [(n, s, f"{n}-seed{s}") for n in names for s in seeds]
    done = [f for _, _, f in every if keep and (keep / f / "pretrain-log.json").exists()]
    if done and gpu_minutes:
        raise SystemExit(f"--gpu-minutes times all runs side by side, but {keep} already holds {', '.join(done)}: "
                         "move them away first")
    if done:
        print(f"already finished in {keep}, not run again: {', '.join(done)}", flush=True)
    runs = [r for r in every if r[2] not in done]
    out.mkdir(parents=True, exist_ok=True)
    finished, failed = pretrain_side_by_side(stage, plan, runs, out, scale, gpu_minutes,
                                             timing_seconds, unpack_root, keep)
    if keep:
        logs = {f: json.loads((keep / f / "pretrain-log.json").read_text()) for f in sorted(done + finished)}
        (out / "pretrain-logs.json").write_text(json.dumps(logs, indent=1))
        if logs:
            archive_runs(out, keep, sorted(logs))
    return 1 if failed else 0


def pretrain_side_by_side(stage: Path, plan: dict, runs: list[tuple[str, int, str]], out: Path, scale: float,
                          gpu_minutes: float | None, timing_seconds: float,
                          unpack_root: Path | None, keep: Path | None) -> tuple[list[str], list[str]]:
    """:func:`pretrain_all`'s runs (recipe, seed, folder) side by side, one process each: kept in
    ``keep``, or compact and all in one archive in ``out`` at the end; the folders finished and failed."""
    if not runs:
        return [], []
    inputs = staged_inputs(stage, plan, unpack_root)
    threads = max(1, (os.cpu_count() or 1) // len(runs))
    folders = keep or out / "checkpoints"
    steps = {f: max(2, round(plan["steps"][n] * scale)) for n, _, f in runs}
    extra: dict[str, dict] = {f: {} for _, _, f in runs}
    finished, failed = [], []
    with ProcessPoolExecutor(len(runs)) as pool:
        if gpu_minutes:
            import multiprocessing

            with multiprocessing.Manager() as manager:
                barrier = manager.Barrier(len(runs))
                try:
                    timings = list(pool.map(time_one, *zip(*[(n, *inputs[n], s, timing_seconds, barrier, threads)
                                                             for n, s, _ in runs], strict=True)))
                except Exception as err:
                    raise SystemExit(f"the timing side by side did not finish: {type(err).__name__}: {err}") from None
            count = gpu_minute_steps([t["steps_per_second"] for t in timings], gpu_minutes)
            print(f"timed side by side for {timing_seconds:g} s: "
                  + ", ".join(f"{f} {t['steps_per_second']:.2f}" for (_, _, f), t in zip(runs, timings, strict=True))
                  + f" steps/s; {count} steps each for {gpu_minutes:g} minutes", flush=True)
            for (_, _, f), t in zip(runs, timings, strict=True):
                steps[f] = count
                extra[f] = {"gpu_minutes": gpu_minutes, "timing": t,
                            "timing_all_steps_per_second": [x["steps_per_second"] for x in timings]}
        futures = {pool.submit(pretrain_one, str(stage), n, steps[f], str(folders), s, f, inputs[n], threads,
                               extra[f], not keep): f for n, s, f in runs}
        for future in as_completed(futures):
            try:
                row = future.result()
            except Exception as err:  # the protocol reports a run that did not finish; it never replaces it
                failed.append(futures[future])
                print(f"run {futures[future]} did not finish: {type(err).__name__}: {err}", flush=True)
                continue
            print(f"pretrained {row['folder']}: {row['steps']} steps on {row['card']} in "
                  f"{row['wall_minutes']:.1f} min, {row['tokens_seen']:,} tokens, last {row['log'][-1]}", flush=True)
            finished.append(row["folder"])
    if keep:
        return finished, failed
    if finished:
        files = archive(out, "runs", folders, sorted(finished))
        size = sum(f.stat().st_size for f in files)
        print(f"archived {len(finished)} checkpoints in {len(files)} file(s), {size / 2**20:.1f} MiB"
              + (f": over the {RETURN_LIMIT / 2**20:.0f} MiB a device call returns" if size > RETURN_LIMIT else ""),
              flush=True)
    shutil.rmtree(folders, ignore_errors=True)
    return finished, failed


def archive_runs(out: Path, keep: Path, members: list[str], limit: int | None = None) -> list[Path]:
    """Compact copies (:func:`compact_checkpoint`, made side by side) of the runs ``members`` of
    ``keep``, archived in ``out`` as ``runs.tar`` or its parts (:func:`archive`) when they come to
    at most ``limit`` bytes (default: what a device call returns, less :data:`RETURN_ROOM`), else
    nothing (reported); the files written. ``keep`` is left as it is."""
    limit = RETURN_LIMIT - RETURN_ROOM if limit is None else limit
    copies = Path(tempfile.mkdtemp(prefix="runs-compact-", dir=keep.parent))
    try:
        for member in members:
            shutil.copytree(keep / member, copies / member)
        with ProcessPoolExecutor(min(len(members), os.cpu_count() or 1)) as pool:
            list(pool.map(compact_checkpoint, [copies / m for m in members]))
        size = folder_bytes(copies)
        if size > limit:
            print(f"not archived: the {len(members)} compact checkpoints are {size / 2**20:.1f} MiB, over the "
                  f"{limit / 2**20:.0f} MiB a device call has room for; they stay in {keep}", flush=True)
            return []
        files = archive(out, "runs", copies, members)
        print(f"archived {len(members)} checkpoints in {len(files)} file(s), "
              f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB", flush=True)
        return files
    finally:
        shutil.rmtree(copies, ignore_errors=True)


def unpack(archives: Path, into: Path) -> Path:
    """The checkpoints folder from the archives (and archive parts) in ``archives``, each
    checkpoint as it was saved (:func:`expand_checkpoint`)."""
    if not archives.is_dir():
        raise SystemExit(f"--checkpoints {archives}: no such folder of checkpoint archives")
    for name in sorted({p.name.split(".tar")[0] for p in archives.glob("*.tar*")}):
        done = into / f"{name}.unpacked"
        if done.exists() or (into / "checkpoints" / name).exists():
            continue
        into.mkdir(parents=True, exist_ok=True)
        whole = into / f"{name}.tar"
        whole.write_bytes(b"".join(p.read_bytes() for p in sorted(archives.glob(f"{name}.tar*"))))
        with tarfile.open(whole) as tar:
            members = sorted({Path(m).parts[1] for m in tar.getnames() if len(Path(m).parts) > 1})
            tar.extractall(into, filter="data")
        whole.unlink()
        for member in members:
            expand_checkpoint(into / "checkpoints" / member)
        done.write_text(json.dumps(members))
    return into / "checkpoints"


# --------------------------------------------------------------------------- evaluate (here)


def run_folders(checkpoints: Path, names: list[str]) -> dict[str, list[tuple[int, Path]]]:
    """Per recipe of ``names``, its runs under ``checkpoints`` as (seed, folder), from the folders
    ``<recipe>-seed<S>`` that hold a model."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for folder in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        name, sep, seed = folder.name.rpartition("-seed")
        if sep and name in names and seed.isdigit() and (folder / "config.json").exists():
            out.setdefault(name, []).append((int(seed), folder))
    return out


def random_init_v2(work: Path, corpus: str, vocab_file: str, seed: int) -> Path:
    """Arm B of a corpus for the choice: the candidates' model config (tiny, pre-LN, 512
    positions: the same for every candidate, since fine-tuning is at 64 tokens whatever the
    pre-training length) from the product's random init for ``seed`` (the weights every
    candidate's run of ``seed`` starts from), with the corpus's vocab."""
    from bert_core.pretrain.data import read_vocab
    from bert_core.pretrain.in_process import save_random_init

    folder = work / "search-v2" / f"random-init-{corpus}-seed{seed}"
    if not (folder / "config.json").exists():
        part = folder.with_name(f"{folder.name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        save_random_init(model_config_for(CANDIDATES_V2["k1"], len(read_vocab(vocab_file))), seed, str(part),
                         vocab_file)
        shutil.rmtree(folder, ignore_errors=True)
        part.rename(folder)
    return folder


def every_setting_jobs(arm: str, checkpoint: Path, task, parts: dict, sizes: list[int], subsamples: int,
                       settings: list[int] | None = None, encodings: dict | None = None) -> list:
    """One checkpoint's dev jobs on one task: every size x subsample (fine-tuned with seed 1 + k)
    x setting of ``the protocol's grid`` (``settings``: their numbers 1-8, default all), keyed for
    the job cache by the arm, its weights and vocab, and the accelerator when it is not the CPU
    (``QUALITY_ACCELERATOR``). ``encodings`` keeps each subsample's features by vocab, so that
    the checkpoints of one corpus tokenize them once."""
    from benchmarks.quality.finetune import ACCELERATOR_VARIABLE, encoded, finetune
    from bert_core.finetune.data import subsample

    vocab = hashlib.sha256((checkpoint / "vocab.txt").read_bytes()).hexdigest()[:16]
    accelerator = os.environ.get(ACCELERATOR_VARIABLE, "cpu")
    ckpt_key = {"search": "v2", "arm": arm, "weights": weights_digest(checkpoint), "vocab": vocab}
    if accelerator != "cpu":
        ckpt_key["accelerator"] = accelerator
    encodings = {} if encodings is None else encodings
    jobs = []
    for size in sizes:
        for k in range(subsamples):
            if (vocab, task.name, size, k) not in encodings:
                encodings[vocab, task.name, size, k] = encoded(
                    str(checkpoint), {"train": subsample(parts["train"], size, task.name, k), "dev": parts["dev"]},
                    task.labels, 64)
            data, pad = encodings[vocab, task.name, size, k]
            for number in settings or range(1, len(GRID) + 1):
                setting = GRID[number - 1]
                key = ckpt_key | {"task": task.name, "size": str(size), "subsample": k, "seed": 1 + k,
                                  "setting": setting, "split": "dev"}
                jobs.append((key, finetune, (str(checkpoint), data, "dev", len(task.labels), setting, 1 + k, pad)))
    return jobs


def run_jobs(cache, work_list: list, jobs: int, seconds: float | None = None) -> list:
    """Each job's value, from ``cache`` or computed by ``jobs`` processes, one started as another
    ends (``cache.run_cached``); with ``seconds``, no job starts after that many seconds."""

    print(f"{sum(cache.lookup(key) is None for key, _, _ in work_list)} of {len(work_list)} jobs to run "
          f"({jobs} at a time)", flush=True)
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        return run_cached(cache, pool, work_list, "choice", in_flight=max(1, jobs), seconds=seconds)


def evaluate(work: Path, checkpoints: Path, plan: dict, samples: Path, jobs: int, output: Path,
                sizes: list[int], subsamples: int, choose: Path | None = None, settings: list[int] | None = None,
                seconds: float | None = None, cache_in: Path | None = None, cache_out: Path | None = None
                ) -> dict | None:
    """The choice on dev: every run of every candidate and every B (a random init per
    corpus and seed of the runs) fine-tuned at every size x subsample x setting of the grid
    (:func:`every_setting_jobs`, all of them in one queue for ``jobs`` processes; finished jobs
    are read from the cache under ``work/search-v2``, which starts as ``cache_in`` holds it when
    missing, so a second call resumes); a candidate's gain in a cell is the mean of its runs and
    subsamples minus the same mean of its corpus's B. Writes every score to ``output`` and, with
    ``choose``, the choice (``choice.choose``). With ``seconds``, jobs left
    when that time is up are not run and nothing is written but the cache: None is returned.
    ``cache_out``: the cache packed into one file at the end, finished or not."""
    import statistics

    from benchmarks.quality import choice as qc
    from benchmarks.quality.finetune import ACCELERATOR_VARIABLE

    names = [n for n in CANDIDATES_V2 if n in plan["steps"]]
    runs = run_folders(checkpoints, names)
    if not runs:
        raise SystemExit(f"{checkpoints}: no checkpoint of a version-2 candidate (folders <recipe>-seed<S>)")
    seeds = sorted({seed for found in runs.values() for seed, _ in found})
    arms: dict[str, dict] = {}
    for corpus in sorted({plan["corpus"][n] for n in runs}):
        for seed in seeds:
            folder = random_init_v2(work, corpus, plan["vocabs"][corpus], seed)
            arms[f"B-{corpus}-seed{seed}"] = {"arm": "B", "corpus": corpus, "seed": seed, "checkpoint": folder}
    for name, found in runs.items():
        for seed, folder in found:
            log = folder / "pretrain-log.json"
            arms[folder.name] = {"arm": name, "corpus": plan["corpus"][name], "seed": seed, "checkpoint": folder,
                                 "pretrain": {k: v for k, v in json.loads(log.read_text()).items() if k != "log"}
                                 if log.exists() else None}
    cache = Cache(work / "search-v2" / "cache", reuse=True, archive=cache_in)
    tasks = {name: qt.load(task, samples) for name, task in qt.TASKS.items()}
    encodings: dict = {}
    work_list, owners = [], []
    for label, arm in arms.items():
        for task_name, parts in tasks.items():
            found = every_setting_jobs(label, arm["checkpoint"], qt.TASKS[task_name], parts, sizes, subsamples,
                                       settings, encodings)
            work_list += found
            owners += [label] * len(found)
    order = sorted(range(len(work_list)), key=lambda i: -int(work_list[i][0]["size"]))  # the longest jobs first
    work_list, owners = [work_list[i] for i in order], [owners[i] for i in order]
    values = run_jobs(cache, work_list, jobs, seconds)
    if cache_out:
        pack_cache(cache.folder, cache_out)
    left = sum(v is None for v in values)
    if left:
        print(f"not finished: {left} of {len(values)} jobs left at the {seconds:g}-second limit; the same command "
              "again runs them (the finished ones are in the job cache)", flush=True)
        return None
    for (key, _, _), label, value in zip(work_list, owners, values, strict=True):
        c = qc.cell(key["task"], key["size"], GRID.index(key["setting"]) + 1)
        arms[label].setdefault("dev_macro_f1", {}).setdefault(c, []).append(value["macro_f1"])
    for label, arm in arms.items():
        scores = arm["dev_macro_f1"]
        print(f"  {label}: dev macro-F1 {statistics.fmean(v for s in scores.values() for v in s):.1f} "
              f"(mean of {len(scores)} cells)", flush=True)
    pooled: dict[str, dict[str, list[float]]] = {}
    for arm in arms.values():
        key = f"B-{arm['corpus']}" if arm["arm"] == "B" else arm["arm"]
        for c, cell_scores in arm["dev_macro_f1"].items():
            pooled.setdefault(key, {}).setdefault(c, []).extend(cell_scores)
    gains = {n: qc.gains(pooled[n], pooled[f"B-{plan['corpus'][n]}"]) for n in names if n in runs}
    numbers = settings or list(range(1, len(GRID) + 1))
    expected = [c for c in qc.cells(list(tasks), tuple(str(s) for s in sizes), len(GRID))
                if int(c.rsplit("/", 1)[1]) in numbers]
    choice = qc.choose(gains, plan["corpus"], expected)
    choice["not_run"] = [n for n in names if n not in runs]
    choice["runs"] = {n: [seed for seed, _ in runs[n]] for n in runs}
    result = {"what": "version 2's recipe choice: each candidate's dev macro-F1 at every size x subsample x "
                      "setting, its gain per cell over random init with its corpus's vocab, and the choice",
              "sizes": [str(s) for s in sizes], "subsamples": subsamples, "grid": GRID, "settings": numbers,
              "accelerator": os.environ.get(ACCELERATOR_VARIABLE, "cpu"), "plan": plan,
              "arms": {label: {k: str(v) if k == "checkpoint" else v for k, v in arm.items()}
                       for label, arm in arms.items()},
              "choice": choice}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    if choose:
        qc.write_choice(choice, choose)
    for row in choice["candidates"]:
        print(f"{row['name']:<10} {row['corpus']}  {len(choice['runs'][row['name']])} run(s)  "
              f"minimum gain {row['minimum']:+.1f}  mean gain {row['mean']:+.1f}")
    if choice["not_run"]:
        print(f"not run: {', '.join(choice['not_run'])}")
    print(f"chosen: {choice['name']} (corpus {choice['corpus']})" + (f"; written to {choose}" if choose else ""))
    return result


def plan_v2(stage: Path, work: Path) -> dict:
    """Version 2's plan: the stage's, its vocabs named by the stage's copies (so that it holds on
    the machine the stage travelled to), else the one prepare left in ``work/search-v2``."""
    if (stage / "steps.json").exists():
        plan = json.loads((stage / "steps.json").read_text())
        if plan.get("candidates") == "v2":
            plan["vocabs"] = {c: str(stage / f"vocab-{c}" / "vocab.txt") for c in plan["vocabs"]}
            return plan
    plan_file = work / "search-v2" / "plan.json"
    if not plan_file.exists():
        raise SystemExit(f"neither {stage}/steps.json nor {plan_file} holds a version-2 plan: run benchmarks.quality "
                         f"prepare --work {work} --stage {stage} first")
    return json.loads(plan_file.read_text())


def checkpoints_folder(path: Path, into: Path) -> Path:
    """``path`` when it holds checkpoints (folders with a ``config.json``), else the folder
    :func:`unpack` makes of the archives in it under ``into``."""
    if path.is_dir() and any((p / "config.json").exists() for p in path.iterdir()):
        return path
    return unpack(path, into)


def numbers(flag: str, text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text}: give integers, comma-separated") from None


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import samples as default_samples

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "pretrain", "evaluate"])
    parser.add_argument("--work", default="/work/quality-runs", help="the test phase's --work")
    parser.add_argument("--stage", default=str(ROOT / ".search-v2"),
                        help="what the pre-training step reads; evaluate reads its plan, vocabs and tasks' files")
    parser.add_argument("--out", default=None, help="pretrain: where the checkpoints' archive goes")
    parser.add_argument("--keep", default=None, help="pretrain --seeds: keep the runs in this folder, skip those "
                        "already there, and archive them in --out only if they fit a device call's return")
    parser.add_argument("--checkpoints", default=None,
                        help="evaluate: folder of the checkpoints, or of the pre-training step's archives")
    parser.add_argument("--samples", default=None, help="the samples folder (default: the stage's copy of the "
                        "tasks' files for evaluate when it has one, else the fetched samples)")
    parser.add_argument("--chosen-steps", type=int, default=14533, help="the protocol's 60-minute step count")
    parser.add_argument("--corpus", default="k1,k2", help="prepare: only the candidates on these")
    parser.add_argument("--tasks-only", action="store_true", help="prepare: only copy the tasks' files into the stage")
    parser.add_argument("--recipes", default="v2", help="pretrain: a version's candidates or recipe names")
    parser.add_argument("--seeds", default=None, help="pretrain: each recipe once per seed (folders <recipe>-seed<S>)")
    parser.add_argument("--gpu-minutes", type=float, default=None,
                        help="pretrain: one step count for all, from a timing of them side by side")
    parser.add_argument("--scale", type=float, default=1.0, help="pretrain: a share of each step count (dry run)")
    parser.add_argument("--jobs", type=int, default=1, help="evaluate: fine-tuning jobs at a time (processes)")
    parser.add_argument("--sizes", default="300,1000", help="evaluate: label counts")
    parser.add_argument("--settings", default=None, help="evaluate: only these grid settings, numbered 1-8 (dry run)")
    parser.add_argument("--subsamples", type=int, default=3, help="evaluate: subsamples a size")
    parser.add_argument("--seconds", type=float, default=None, help="evaluate: start no job after this many "
                        "seconds; the same command again runs the rest (status 3 until then)")
    parser.add_argument("--cache-in", default=None,
                        help="evaluate: the job cache starts as this packed file holds it when missing")
    parser.add_argument("--cache-out", default=None, help="evaluate: the job cache packed into this file at the end")
    parser.add_argument("--choose", default=None, help="evaluate: write the choice here")
    parser.add_argument("--output", default=str(ROOT / "bench-results" / "quality-v2-search.json"),
                        help="evaluate: every score")
    args = parser.parse_args(argv)
    work, stage = Path(args.work), Path(args.stage)
    if args.step == "pretrain":
        if not args.out:
            raise SystemExit("pretrain needs --out, the folder the checkpoints' archives go to")
        seeds = numbers("--seeds", args.seeds) if args.seeds else None
        if args.gpu_minutes is not None and args.gpu_minutes <= 0:
            raise SystemExit(f"--gpu-minutes {args.gpu_minutes:g}: give a positive number of minutes")
        return pretrain_all(stage, Path(args.out), recipe_names(args.recipes), args.scale, seeds, args.gpu_minutes,
                            keep=Path(args.keep) if args.keep else None)
    if args.step == "prepare":
        samples = Path(args.samples) if args.samples else default_samples()
        plan = restage_tasks(work, stage, samples) if args.tasks_only else prepare(
            work, stage, samples, args.chosen_steps, [c.strip() for c in args.corpus.split(",")])
        print(json.dumps(plan, indent=1))
        return 0
    if not args.checkpoints:
        raise SystemExit("evaluate needs --checkpoints, the folder of the checkpoints or of their archives")
    plan = plan_v2(stage, work)
    settings = numbers("--settings", args.settings) if args.settings else None
    if settings and not all(1 <= n <= len(GRID) for n in settings):
        raise SystemExit(f"--settings {args.settings}: the grid's settings are numbered 1 to {len(GRID)}")
    if args.seconds is not None and args.seconds <= 0:
        raise SystemExit(f"--seconds {args.seconds:g}: give a positive number of seconds")
    samples = Path(args.samples) if args.samples else (
        stage / STAGE_SAMPLES if (stage / STAGE_SAMPLES).is_dir() else default_samples())
    folder = checkpoints_folder(Path(args.checkpoints), work / "search-v2" / "gpu")
    result = evaluate(work, folder, plan, samples, args.jobs, Path(args.output), numbers("--sizes", args.sizes),
                      args.subsamples, Path(args.choose) if args.choose else None, settings, args.seconds,
                      Path(args.cache_in) if args.cache_in else None, Path(args.cache_out) if args.cache_out else None)
    return 0 if result else 3


if __name__ == "__main__":
    sys.exit(main())
