"""The corpus stage's inputs: globs expanded to files before any work starts, and book ids.

    (beam_jobs/clean_corpus.py and flows/corpus.py expand ``corpus.wikipedia`` / ``corpus.books``)
"""

from __future__ import annotations

from collections.abc import Iterable

from bert_core import storage
from bert_core.config import ConfigError
from bert_core.corpus.books import book_stem

# Compressed inputs count this many times their size: about what text shrinks to.
COMPRESSED = (".bz2", ".gz", ".zst")
TEXT_PER_COMPRESSED_BYTE = 4


def text_bytes(uri: str, size: int) -> int:
    """The bytes of text a file of ``size`` bytes holds, a compressed one by its ratio."""
    return size * TEXT_PER_COMPRESSED_BYTE if uri.endswith(COMPRESSED) else size


# On the local runner, one worker process per this many bytes of text, up to ``workers``: a worker
# process costs Beam's start-up (about a CPU-second and a hundred MB), more than a second core
# saves on a tiny input. Any real corpus starts every worker.
LOCAL_BYTES_PER_WORKER = 4 << 20


def local_workers_for(workers: int, text_bytes_total: int, bytes_per_worker: int = LOCAL_BYTES_PER_WORKER) -> int:
    """Worker processes for ``text_bytes_total`` bytes of text: one per ``bytes_per_worker``, at
    least one, at most ``workers``; every one of ``workers`` if ``bytes_per_worker`` is 0."""
    if bytes_per_worker <= 0:
        return max(1, workers)
    return max(1, min(workers, -(-text_bytes_total // bytes_per_worker)))


class InputError(ConfigError):
    """Missing input paths or empty globs of the config: raised before any work starts."""


def expand_inputs(patterns: Iterable[str], what: str) -> list[str]:
    """Files matching each glob (a folder means every file in it); fail at once on no match."""
    files: list[str] = []
    for pattern in patterns:
        pattern = str(pattern)
        is_glob = any(c in pattern for c in "*?[")
        if not is_glob and storage.exists(pattern) and not storage.glob(pattern):
            matched = storage.glob(storage.join(pattern, "*"))  # a folder
        else:
            matched = storage.glob(pattern)
        if not matched:
            hint = ("the glob matched no files" if is_glob else
                    "the folder is empty" if storage.exists(pattern) else "the path does not exist")
            raise InputError(
                f"{what} input {pattern!r}: {hint}. Check the path (relative paths start at "
                f"{storage.to_uri('.')}); sample data comes from `bertpipe samples fetch samples`"
            )
        files += matched
    return sorted(set(files))


def book_ids(files: list[str]) -> dict[str, str]:
    """doc_id per book file: ``book:<stem>``, with the parent folder added when stems collide."""
    stems = [book_stem(f) for f in files]
    ids = {}
    for f, stem in zip(files, stems, strict=True):
        if stems.count(stem) > 1:
            stem = f"{f.rstrip('/').rsplit('/', 2)[-2]}/{stem}"
        ids[f] = f"book:{stem}"
    return ids
