"""The product path the protocol pre-trains on: ``bertpipe corpus``, ``vocab``, ``instances`` and
``pretrain`` run as a user types them, arm B's random init, and the CPU cost of a run.

    corpus, vocab = corpus_and_vocab(corpus_inputs(samples), work)
    done = pretrain(RECIPES[CHOSEN], instances_for(RECIPES[CHOSEN], corpus, vocab, work), run, steps, ranks=1)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import measure
from benchmarks.quality.spec import PRETRAIN_SEED, Recipe
from bert_core.config import load_config
from bert_core.pretrain.metrics import read_metrics
from bert_core.storage import sha256


def bertpipe(args: list[str], log: Path) -> float:
    """Run a ``bertpipe`` command as a user types it, its output added to ``log``; its CPU seconds
    (the whole process tree, ``benchmarks.common.measure``)."""
    print("  $ bertpipe " + " ".join(args), flush=True)
    return measure([sys.executable, "-m", "flows.cli", *args], log)["cpu_s"]


def corpus_inputs(sample_dir: Path | None = None) -> list[tuple[str, str]]:
    """The demo preset's corpus as ``bertpipe corpus`` options: (flag, glob) pairs, the globs as the
    preset names them, or under ``sample_dir`` when given."""
    from flows.demo import demo_config

    cfg = (demo_config(str(sample_dir), []) if sample_dir else load_config("demo")).corpus
    return [(flag, p) for flag, globs in (("--wikipedia", cfg.wikipedia), ("--books", cfg.books),
                                          ("--text", cfg.text)) for p in globs]


def corpus_and_vocab(inputs: list[tuple[str, str]], work: Path) -> tuple[Path, Path]:
    """The corpus and vocab stages with the demo preset on ``inputs``, built once per set of inputs
    (a change of inputs removes the corpus and everything built from it)."""
    corpus, vocab = work / "corpus", work / "vocab"
    stamp = work / "corpus-inputs.json"
    # a file input (the filtered tweets) is named with its sha256: new content, new corpus
    inputs = [(flag, f"{p}#{sha256(p)[:16]}" if Path(p).is_file() else p)
              for flag, p in inputs]
    if not stamp.exists() or json.loads(stamp.read_text()) != [list(i) for i in inputs]:
        for built in [corpus, vocab, *work.glob("instances-*")]:
            shutil.rmtree(built, ignore_errors=True)
    if not (corpus / "_MANIFEST.json").exists():
        args = [a.split("#")[0] for i in inputs for a in i]
        bertpipe(["corpus", *args, "--output", str(corpus)], work / "corpus.log")
        stamp.write_text(json.dumps(inputs))
    if not (vocab / "_MANIFEST.json").exists():
        bertpipe(["vocab", "--corpus", str(corpus), "--output", str(vocab)], work / "vocab.log")
    return corpus, vocab


def instances_for(recipe: Recipe, corpus: Path, vocab: Path, work: Path) -> Path:
    """The instances stage with the recipe's settings, built once per distinct setting."""
    key = "-".join([f"seq{recipe.seq}", "nsp" if recipe.next_sentence_prediction else "packed", recipe.masking,
                    "wwm" if recipe.whole_word_mask else "wordpiece"])
    out = work / f"instances-{key}"
    if not (out / "_MANIFEST.json").exists():
        cmd = ["instances", "--corpus", str(corpus), "--vocab", str(vocab), "--output", str(out)]
        for s in recipe.instance_sets():
            cmd += ["--set", s]
        bertpipe(cmd, work / f"instances-{key}.log")
    return out


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: another process doing the same work waits for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pretrain(recipe: Recipe, instances: Path, run: Path, steps: int, ranks: int, seed: int = PRETRAIN_SEED) -> dict:
    """``bertpipe pretrain`` with the recipe's settings for ``steps``, resumed from the run's last
    checkpoint when a killed run left one: CPU minutes, final eval. ``run/done.json`` holds the
    result of a finished run, which is then not run again."""
    done_file = run / "done.json"
    with locked(run.parent / f"{run.name}.lock"):
        if done_file.exists() and (run / "hf" / "config.json").exists():
            return json.loads(done_file.read_text())
        cmd = ["pretrain", "--instances", str(instances), "--output", str(run)]
        for s in recipe.pretrain_sets(steps, ranks, seed):
            cmd += ["--set", s]
        started = time.perf_counter()
        cpu = bertpipe(cmd, run.parent / f"{run.name}.log")
        rows = read_metrics(str(run))
        evals = [r for r in rows if r.get("kind") == "eval"]
        train = [r for r in rows if r.get("kind", "train") == "train"]
        done = {"steps": steps, "cpu_minutes_this_session": cpu / 60,
                "wall_minutes_this_session": (time.perf_counter() - started) / 60,
                "train_cpu_minutes": train_cpu_seconds(rows) / 60, "last_loss": train[-1]["loss"] if train else None,
                "eval": {k: evals[-1].get(k) for k in ("mlm_loss", "mlm_acc", "instances")} if evals else None}
        done_file.write_text(json.dumps(done))
        return done


def baseline(recipe: Recipe, instances: Path, folder: Path, seed: int = PRETRAIN_SEED) -> Path:
    """Arm B: the product's random init (``bert_core.pretrain.in_process.save_random_init``) of the
    model config pre-training would build for ``seed``, with the same vocab."""
    from bert_core.pretrain.data import read_vocab, vocab_file_of
    from bert_core.pretrain.in_process import save_random_init
    from bert_core.pretrain.run_folder import model_config

    if (folder / "config.json").exists():
        return folder
    cfg = load_config("demo", None, recipe.pretrain_sets(1, 1, seed))
    vocab_file = vocab_file_of(str(instances))
    save_random_init(model_config(cfg, len(read_vocab(vocab_file))), cfg.pretrain.seed, str(folder), vocab_file,
                     cfg.vocab.lowercase)
    return folder


def train_cpu_seconds(rows: list[dict]) -> float:
    """CPU seconds of training steps over a run's train rows; a resumed run's counter starts
    again, so only increases between rows of one process count."""
    rows = [r for r in rows if r.get("kind", "train") == "train" and "cpu_seconds" in r]
    return sum(max(0.0, b["cpu_seconds"] - a["cpu_seconds"]) for a, b in zip(rows, rows[1:], strict=False)
               if b["cpu_seconds"] >= a["cpu_seconds"])


def cpu_per_step(rows: list[dict]) -> float:
    """CPU seconds (all ranks) one training step costs, from the train rows past the first quarter."""
    rows = [r for r in rows if r.get("kind", "train") == "train" and "cpu_seconds" in r]
    late = [r for r in rows if r["step"] > rows[-1]["step"] // 4] or rows
    first, last = (late[0], late[-1]) if len(late) > 1 else (rows[0], rows[-1])
    if last["step"] == first["step"]:
        raise ValueError("the calibration run logged one step only; give it more steps")
    return (last["cpu_seconds"] - first["cpu_seconds"]) / (last["step"] - first["step"])


def steps_in_budget(cpu_minutes: float, seconds_per_step: float) -> int:
    """Optimizer steps whose CPU cost fits ``cpu_minutes`` (at least 1)."""
    return max(1, int(cpu_minutes * 60 / seconds_per_step))


def instances_digest(folder: Path) -> str:
    """What the instances hold, not when or where they were made (which their manifest records):
    the vocab's sha256 and each shard's."""
    parts = [json.loads((folder / "_MANIFEST.json").read_text())["vocab_sha256"]]
    parts += [f"{p.relative_to(folder).as_posix()} {sha256(str(p))}" for p in sorted(folder.rglob("*.parquet"))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
