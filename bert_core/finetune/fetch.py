"""Fetch the fine-tuning tasks' data from where their authors publish it, into the layout the
task readers expect: ``<data_dir>/<Task.folder>/``.

    bertpipe tasks fetch glue squad swag          (-> <storage_root>/tasks/CoLA/, ..., squad/, swag/)

Each official file is fetched with HTTP ``Range`` into a local ``.part`` file (the resumable
machinery of :mod:`bert_core.corpus.download`: a broken transfer or a killed process continues
where it stopped), checked against the size and sha256 pinned in :data:`SOURCES`, then unpacked:
a GLUE zip's ``<TASK>/*`` files into the task folder, MRPC's three files split into
``train.tsv``/``dev.tsv``/``test.tsv`` as GLUE's own download script splits them, SQuAD's JSON and
SWAG's CSV files as they are. ``_MANIFEST.json`` (stage ``tasks-fetch``) is written last, with
the sha256 of every source and every file written; a folder whose manifest lists every file as
written is not fetched again.

The pinned sizes and sha256 are those the Hugging Face ``datasets`` library records for the same
official URLs. A file without a published checksum (CoNLL-2003 from a mirror the user names,
``--url ner=URL``) is trusted on its first fetch: its sha256 goes into the manifest and a later
fetch into that folder must match it.

CoNLL-2003 (``ner``) has no public copy its licence allows (it is built from the Reuters RCV1
corpus): :func:`fetch_task` says where to get it and where to put the files.

``$BERTPIPE_TASKS_URL`` (or ``base=``) maps every official host to a mirror:
``https://dl.fbaipublicfiles.com/glue/data/CoLA.zip`` is fetched from
``$BERTPIPE_TASKS_URL/dl.fbaipublicfiles.com/glue/data/CoLA.zip``; tests serve such a tree on
127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bert_core import lease, storage
from bert_core.config import ConfigError
from bert_core.corpus.download import drop_if_empty, fetch_resumable, publish, reusable, staging_dir
from bert_core.failures import Refusal
from bert_core.finetune import TASKS, task_files

STAGE = "tasks-fetch"
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
_GLUE = "https://dl.fbaipublicfiles.com/glue/data"
_SENTEVAL = "https://dl.fbaipublicfiles.com/senteval/senteval_data"
_SQUAD = "https://rajpurkar.github.io/SQuAD-explorer/dataset"
_SWAG = "https://raw.githubusercontent.com/rowanz/swagaf/master/data"
NER_FILES = ("train.txt", "valid.txt", "test.txt")
NER_HELP = (
    "ner: CoNLL-2003 has no public copy its licence allows; get the Reuters RCV1 corpus "
    "(trec.nist.gov/data/reuters/reuters.html), build the English files with the CoNLL-2003 scripts "
    "(www.clips.uantwerpen.be/conll2003/ner/), and put them in {folder}/{{train,valid,test}}.txt "
    "(or fetch them from a mirror you may use: --url ner=URL of a folder with those three files)"
)


class TaskFetchError(Refusal):
    """Task data that cannot be fetched or unpacked as asked."""


class TaskChecksumError(TaskFetchError):
    """A fetched file is not the one its publisher lists (size or sha256)."""


class TaskNameError(ConfigError):
    """A name ``tasks fetch`` does not know."""


@dataclass(frozen=True)
class Source:
    """One official file: its URL and, where published, its size and sha256."""

    url: str
    size: int | None = None
    sha256: str | None = None

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class TaskData:
    """What one task's folder is made from, and how (``zip``, ``mrpc``, ``files``)."""

    sources: tuple[Source, ...]
    unpack: str


def _glue(name: str, size: int, sha256: str) -> TaskData:
    return TaskData((Source(f"{_GLUE}/{name}", size, sha256),), "zip")


SOURCES: dict[str, TaskData] = {
    "cola": _glue("CoLA.zip", 376971, "f212fcd832b8f7b435fb991f101abf89f96b933ab400603bf198960dfc32cbff"),
    "sst2": _glue("SST-2.zip", 7439277, "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa"),
    "mrpc": TaskData((
        Source(f"{_SENTEVAL}/msr_paraphrase_train.txt", 1047044,
               "60a9b09084528f0673eedee2b69cb941920f0b8cd0eeccefc464a98768457f89"),
        Source(f"{_SENTEVAL}/msr_paraphrase_test.txt", 441275,
               "a04e271090879aaba6423d65b94950c089298587d9c084bf9cd7439bd785f784"),
        Source(f"{_GLUE}/mrpc_dev_ids.tsv", 6222, "971d7767d81b997fd9060ade0ec23c4fc31cbb226a55d1bd4a1bac474eb81dc7"),
    ), "mrpc"),
    "stsb": _glue("STS-B.zip", 802872, "e60a6393de5a8b5b9bac5020a1554b54e3691f9d600b775bd131e613ac179c85"),
    "qqp": _glue("QQP-clean.zip", 41696084, "40e7c862c04eb26ee04b67fd900e76c45c6ba8e6d8fab4f8f1f8072a1a3fbae0"),
    "mnli": _glue("MNLI.zip", 312783507, "e7c1d896d26ed6caf700110645df426cc2d8ebf02a5ab743d5a5c68ac1c83633"),
    "qnli": _glue("QNLIv2.zip", 10627589, "e634e78627a29adaecd4f955359b22bf5e70f2cbd93b493f2d624138a0c0e5f5"),
    "rte": _glue("RTE.zip", 697150, "6bf86de103ecd335f3441bd43574d23fef87ecc695977a63b82d5efb206556ee"),
    "wnli": _glue("WNLI.zip", 28999, "ae0e8e4d16f4d46d4a0a566ec7ecceccfd3fbfaa4a7a4b4e02848c0f2561ac46"),
    "squad": TaskData((
        Source(f"{_SQUAD}/train-v1.1.json", 30288272, "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955"),
        Source(f"{_SQUAD}/dev-v1.1.json", 4854279, "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"),
    ), "files"),
    "squad_v2": TaskData((
        Source(f"{_SQUAD}/train-v2.0.json", 42123633, "68dcfbb971bd3e96d5b46c7177b16c1a4e7d4bdef19fb204502738552dede002"),
        Source(f"{_SQUAD}/dev-v2.0.json", 4370528, "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8"),
    ), "files"),
    "swag": TaskData((
        Source(f"{_SWAG}/train.csv", 28243333, "5748b51126ac255c5a6f26e1ba473b51116d6c822aeb25e63ecba282c9d0e610"),
        Source(f"{_SWAG}/val.csv", 7893588, "c0497b2cd7f3e6b7df995524b1853f62285d60d110d659b19545ca80b2903234"),
        Source(f"{_SWAG}/test.csv", 7817885, "a689a1a4e892a65ca625c1f0fcf77bcce004b59ad1caeb134ca5ec080a711cb6"),
    ), "files"),
    "ner": TaskData((), "files"),  # no public source: NER_HELP, or --url ner=URL
}
NAMES = ("glue", *SOURCES)


def task_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """The tasks ``names`` ask for, in order, once each (``glue`` = its nine tasks)."""
    if not names:
        raise TaskNameError(f"name the task data to fetch: {', '.join(NAMES)}")
    out: list[str] = []
    for raw in names:
        name = raw.lower()
        if name not in NAMES:
            raise TaskNameError(f"unknown task data {raw!r}; tasks fetch knows: {', '.join(NAMES)}")
        out += [n for n in (GLUE_TASKS if name == "glue" else (name,)) if n not in out]
    return out


def missing_hint(name: str, data_dir: str, default_dir: str) -> str | None:
    """What to run (or do) when task ``name``'s data is not under ``data_dir``; None for a task
    ``tasks fetch`` does not serve. ``default_dir`` is where ``tasks fetch`` puts it unasked."""
    base = name.split("@")[0].lower()
    if base not in SOURCES and base != "ner_bilstm":
        return None
    if base in ("ner", "ner_bilstm"):
        return (f"put the CoNLL-2003 files in {storage.join(data_dir, 'ner')}/{{train,valid,test}}.txt "
                "('bertpipe tasks fetch ner' says where to get them)")
    to = "" if storage.to_uri(data_dir) == storage.to_uri(default_dir) else f" --to {data_dir}"
    return f"run 'bertpipe tasks fetch {base}{to}'"


def mirror_url(url: str, base: str | None = None) -> str:
    """``url`` as fetched: from ``base`` (or ``$BERTPIPE_TASKS_URL``) + ``/<host>/<path>`` when set."""
    base = base or os.environ.get("BERTPIPE_TASKS_URL")
    if not base:
        return url
    parts = urlsplit(url)
    return f"{base.rstrip('/')}/{parts.netloc}{parts.path}"


def _present(data_dir: str, name: str) -> bool:
    from bert_core.finetune.errors import TaskFileMissing

    try:
        task_files(data_dir, name)
    except TaskFileMissing:
        return False
    return True


def fetch_task(
    name: str,
    data_dir: str,
    *,
    url: str | None = None,
    base: str | None = None,
    staging: str | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    table: dict[str, TaskData] | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> dict | None:
    """Fetch, verify and unpack task ``name`` into ``<data_dir>/<Task.folder>``; its manifest
    (None for ``ner`` files put there by hand).

    ``url`` is a folder holding the task's files under their official names (for ``ner``:
    ``train.txt``, ``valid.txt`` and ``test.txt``), checked like the official ones. ``table`` is :data:`SOURCES` unless a caller
    pins other files.
    """
    folder = storage.join(data_dir, TASKS[name].folder)
    wanted = {"task": name}
    if (done := reusable(folder, STAGE, wanted)) is not None:
        log(f"{name}: {storage.to_uri(folder)} already fetched and verified")
        return done
    if name == "ner" and not url and _present(data_dir, name):
        log(f"ner: {storage.to_uri(folder)} holds the CoNLL-2003 files; nothing to fetch")
        return None
    data = _sources(name, folder, url, SOURCES if table is None else table)
    stage_dir = Path(staging) if staging else staging_dir(folder, f"task-{name}")
    try:
        with lease.hold(folder, STAGE) as held:
            if (done := reusable(folder, STAGE, wanted)) is not None:
                log(f"{name}: {storage.to_uri(folder)} fetched by another run meanwhile; verified")
                return done
            known = _recorded_sha256(folder)
            if storage.has_manifest(folder):  # damaged: its files are about to be rewritten
                storage.remove(storage.join(folder, storage.MANIFEST), recursive=False)
            stage_dir.mkdir(parents=True, exist_ok=True)
            parts, fetched = {}, []
            for source in data.sources:
                got = mirror_url(source.url, base)
                part = stage_dir / (source.name + ".part")
                log(f"{name}: downloading {got}")
                fetch_resumable(got, part, size=source.size, retries=retries, backoff=backoff, log=log)
                digest = _verify(name, source, part, known.get(source.url))
                parts[source.name] = part
                fetched.append({"url": source.url, "fetched_from": got, "bytes": part.stat().st_size,
                                "sha256": digest, "published": source.sha256 is not None})
            written = _UNPACK[data.unpack](parts, folder)
            for part in parts.values():
                part.unlink(missing_ok=True)
            task_files(data_dir, name)  # the reader finds what it reads
            shards = [storage.shard_entry(storage.join(folder, f)) for f in written]
            held.check()
            manifest = storage.write_manifest(
                folder, fence=lease.fence(folder, held.attempt), stage=STAGE, config={**wanted, "folder": TASKS[name].folder, "sources": fetched},
                shards=shards, counts={"files": len(shards), "bytes": sum(s["bytes"] for s in shards)})
    finally:
        if not staging:  # a part kept for the next run keeps its folder
            drop_if_empty(stage_dir)
        if not storage.has_manifest(folder):
            drop_if_empty(folder)
    log(f"{name}: {len(shards)} file(s) verified -> {storage.to_uri(folder)}")
    return manifest


def _sources(name: str, folder: str, url: str | None, table: dict[str, TaskData]) -> TaskData:
    """The files to fetch for ``name``; for ``ner`` those of ``url``, or a refusal saying where
    the data comes from."""
    if name != "ner":
        if url:
            return TaskData(tuple(Source(f"{url.rstrip('/')}/{s.name}", s.size, s.sha256)
                                  for s in table[name].sources), table[name].unpack)
        return table[name]
    if not url:
        raise TaskFetchError(NER_HELP.format(folder=storage.to_uri(folder)))
    return TaskData(tuple(Source(f"{url.rstrip('/')}/{f}") for f in NER_FILES), "files")


def _recorded_sha256(folder: str) -> dict[str, str]:
    """URL -> sha256 of each source an earlier fetch into ``folder`` recorded (a manifest whose
    files are damaged still says what its sources were)."""
    try:
        sources = json.loads(storage.read_text(storage.join(folder, storage.MANIFEST)))["config"]["sources"]
        return {s["url"]: s["sha256"] for s in sources}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _verify(name: str, source: Source, part: Path, recorded: str | None) -> str:
    """The sha256 of ``part``, refused (and the part deleted) when it is not the file published
    (or recorded by an earlier fetch)."""
    size = part.stat().st_size
    digest = storage.sha256(str(part))
    expected, whose = (source.sha256, "published") if source.sha256 else (recorded, "recorded at its first fetch")
    problem = None
    if source.size is not None and size != source.size:
        problem = f"{size:,} bytes, the publisher lists {source.size:,}"
    elif expected and digest != expected:
        problem = f"sha256 {digest} is not the {whose} {expected}"
    if problem:
        part.unlink()
        raise TaskChecksumError(f"{name}: {source.url}: {problem}; the partial file was deleted: check "
                                "the mirror ($BERTPIPE_TASKS_URL) or run the same command again")
    return digest


# --------------------------------------------------------------------------- unpacking


def _unzip(parts: dict[str, Path], folder: str) -> list[str]:
    """Each zip's ``<TASK>/<file>`` members into ``folder`` (deeper folders, such as MNLI's
    ``original/``, are left in the zip); the names written."""
    written: list[str] = []
    for name, part in parts.items():
        try:
            with zipfile.ZipFile(part) as archive:
                for member in archive.infolist():
                    pieces = member.filename.split("/")
                    if member.is_dir() or len(pieces) != 2 or pieces[0].startswith("__MACOSX"):
                        continue
                    with archive.open(member) as src, storage.open_file(storage.join(folder, pieces[1]), "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                    written.append(pieces[1])
        except zipfile.BadZipFile as err:
            raise TaskFetchError(f"{name}: not a zip file ({err}); run the same command again") from None
        if not written:
            raise TaskFetchError(f"{name}: holds no <TASK>/<file> members; is this a GLUE zip?")
    return written


def _mrpc(parts: dict[str, Path], folder: str) -> list[str]:
    """GLUE's MRPC: the pairs of ``mrpc_dev_ids.tsv`` from Microsoft's train file are ``dev.tsv``,
    the rest ``train.tsv``; the test file without its labels, numbered, is ``test.tsv``."""

    def rows(path: Path) -> tuple[str, list[list[str]]]:
        lines = path.read_text(encoding="utf-8").lstrip("\ufeff").splitlines()
        return lines[0], [line.split("\t") for line in lines[1:] if line.strip()]

    dev_ids = {tuple(line.split("\t")[:2]) for line in
               parts["mrpc_dev_ids.tsv"].read_text(encoding="utf-8").splitlines() if line.strip()}
    header, train = rows(parts["msr_paraphrase_train.txt"])
    _, test = rows(parts["msr_paraphrase_test.txt"])
    bad = [r for r in train + test if len(r) != 5]
    if bad:
        raise TaskFetchError(f"MRPC: a row with {len(bad[0])} columns, not 5; is this Microsoft's MRPC file?")
    files = {
        "train.tsv": [header, *("\t".join(r) for r in train if tuple(r[1:3]) not in dev_ids)],
        "dev.tsv": [header, *("\t".join(r) for r in train if tuple(r[1:3]) in dev_ids)],
        "test.tsv": ["index\t#1 ID\t#2 ID\t#1 String\t#2 String",
                     *(f"{i}\t" + "\t".join(r[1:]) for i, r in enumerate(test))],
    }
    for name, lines in files.items():
        storage.write_text(storage.join(folder, name), "\n".join(lines) + "\n")
    return list(files)


def _files(parts: dict[str, Path], folder: str) -> list[str]:
    """Each file as it is published, under its own name."""
    for name, part in parts.items():
        publish(part, storage.join(folder, name))
    return list(parts)


_UNPACK: dict[str, Callable[[dict[str, Path], str], list[str]]] = {"zip": _unzip, "mrpc": _mrpc, "files": _files}
