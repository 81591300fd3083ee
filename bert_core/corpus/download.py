"""Download a Wikipedia dump from the Wikimedia dump site: resumable, sha1-verified, with a manifest.

    bertpipe download wikipedia --date 20240601 --lang en     (-> <storage_root>/downloads/wikipedia/enwiki-20240601/)

Each file of one dump job is fetched with HTTP ``Range`` requests into a local ``.part`` file
(a broken transfer or a killed process continues where it stopped) and moved to its destination
(any fsspec URI) only after its sha1 matches and, for a ``.bz2``, it ends as a bz2 stream ends.
The base URL is a setting (``base_url=`` or ``$BERTPIPE_DUMPS_URL``) so mirrors and tests (a
server on 127.0.0.1) work the same.

A dump lands in :func:`wikipedia_folder` unless told otherwise. One attempt at a time writes a
destination (it holds :mod:`bert_core.lease` on it, and its ``.part`` files live in a staging
folder of that destination's own, :func:`staging_dir`); a destination whose manifest lists every
file as written is reused, not fetched again. :func:`fetch_resumable` and :func:`staging_dir` are
the resumable machinery other downloads (``bert_core.finetune.fetch``) use too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bert_core import lease, storage
from bert_core.config import ConfigError
from bert_core.failures import InfrastructureError, Refusal, is_infrastructure_error

DEFAULT_BASE_URL = "https://dumps.wikimedia.org"
# The dump site's jobs with the articles: split into numbered files (``pages-articles1.xml-p1p41242.bz2``,
# ...) or recombined into one (``pages-articles.xml.bz2``), plain or multistream. The presets' glob
# reads any of them; download one form of a dump, not two.
JOBS = ("articlesdump", "articlesdumprecombine", "articlesmultistreamdump", "articlesmultistreamdumprecombine")
_CHUNK = 1 << 20


class DownloadError(Refusal):
    """The dump cannot be fetched as asked (missing or unfinished)."""


class DumpOptionError(ConfigError, DownloadError):
    """A dump date or language that cannot name a dump."""


class ChecksumError(DownloadError):
    """A downloaded file does not have the sha1 the dump site lists for it."""


class CutFileError(DownloadError):
    """A downloaded file has its listed sha1 but is cut short: the dump site serves it so."""


class TransferError(InfrastructureError):
    """The network or the dump site gave up; running the same command again resumes."""


@dataclass(frozen=True)
class DumpFile:
    name: str
    url: str
    size: int | None
    sha1: str


def wikipedia_folder(storage_root: str, lang: str, date: str) -> str:
    """``<storage_root>/downloads/wikipedia/<lang>wiki-<date>``: where a dump lands by default and
    where the bert-base presets' ``corpus.wikipedia`` globs read."""
    return storage.join(storage_root, "downloads", "wikipedia", f"{lang}wiki-{date}")


def staging_dir(dest: str, label: str) -> Path:
    """The local folder of ``dest``'s ``.part`` files: one per destination (``label`` keeps it
    readable), so running the same command again resumes them and no other destination's
    download touches them."""
    key = hashlib.sha256(storage.to_uri(dest).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "bertpipe-download" / f"{label}-{key}"


def drop_if_empty(folder: str | Path) -> None:
    """Remove a local folder that holds nothing (a staging folder after its last part was moved,
    a destination after a failed first attempt); anything else is left alone."""
    path = Path(storage.to_uri(str(folder))) if storage.is_local(str(folder)) else None
    if path is not None and path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def reusable(folder: str, stage: str, wanted: dict) -> dict | None:
    """The manifest of ``folder`` when it was written by ``stage`` with the ``wanted`` config
    entries and every file it lists is there as written (sizes; sha256 up to
    :data:`storage.CHECKSUM_BYTES`); None when the folder must be (re)fetched."""
    if not storage.has_manifest(folder):
        return None
    try:
        manifest = storage.read_manifest(folder)
    except storage.ManifestError:
        return None
    config = manifest.get("config") or {}
    if manifest.get("stage") != stage or any(config.get(k) != v for k, v in wanted.items()):
        return None
    return None if storage.shard_problems(folder, manifest) else manifest


def base_url(explicit: str | None = None) -> str:
    return (explicit or os.environ.get("BERTPIPE_DUMPS_URL") or DEFAULT_BASE_URL).rstrip("/")


def dump_url(base: str, lang: str, date: str) -> str:
    if not re.fullmatch(r"\d{8}", date):
        raise DumpOptionError(f"--date {date!r}: expected YYYYMMDD, e.g. 20240601 (a dump date)")
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", lang):
        raise DumpOptionError(f"--lang {lang!r}: expected a wiki language code such as en or de")
    return f"{base}/{lang}wiki/{date}"


def _get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        hint = " (no dump for this date/lang? see the dump index)" if err.code == 404 else ""
        kind = TransferError if is_infrastructure_error(err) else DownloadError
        raise kind(f"GET {url}: HTTP {err.code}{hint}") from None
    except (urllib.error.URLError, OSError) as err:
        raise TransferError(f"GET {url}: {err}; check the network or --base-url") from None


def parse_sha1sums(text: str) -> dict[str, str]:
    """``<sha1>  <name>`` lines -> {name: sha1}."""
    sums = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"[0-9a-f]{40}", parts[0]):
            sums[parts[1].lstrip("*")] = parts[0]
    return sums


def list_dump_files(
    lang: str, date: str, *, job: str = "articlesdump", base: str | None = None, timeout: float = 30
) -> list[DumpFile]:
    """The files of one finished dump job, with sha1s cross-checked between the two listings.

    The dump site publishes, per wiki and date (``{base}/{lang}wiki/{date}/``),
    ``dumpstatus.json`` (every dump job with its status and files: name, url, size, sha1, md5) and
    ``{lang}wiki-{date}-sha1sums.txt`` (``<sha1>  <file name>`` per line). The job is
    one of ``JOBS`` (``articlesdump``: the split ``pages-articles<N>.xml-p<a>p<b>.bz2`` files; the
    ``...recombine`` jobs: one file; a multistream form of each); a job that is
    not ``done`` is refused.
    """
    if job not in JOBS:
        raise DownloadError(f"job {job!r}: choose one of {', '.join(JOBS)}")
    root = dump_url(base_url(base), lang, date)
    status_url = f"{root}/dumpstatus.json"
    try:
        status = json.loads(_get(f"{status_url}", timeout))
    except json.JSONDecodeError as err:
        raise DownloadError(f"{status_url}: not JSON ({err})") from None
    entry = status.get("jobs", {}).get(job)
    if entry is None:
        raise DownloadError(f"{status_url}: no job {job!r} (jobs: {sorted(status.get('jobs', {}))})")
    if entry.get("status") != "done":
        raise DownloadError(
            f"{status_url}: job {job} is {entry.get('status')!r}, not 'done'; the dump is still "
            "being written: pick an earlier --date or wait for it to finish"
        )
    sums_url = f"{root}/{lang}wiki-{date}-sha1sums.txt"
    sums = parse_sha1sums(_get(sums_url, timeout).decode("utf-8", "replace"))
    files = []
    for name, info in sorted(entry.get("files", {}).items()):
        sha1 = info.get("sha1") or sums.get(name)
        if not sha1:
            raise DownloadError(f"{name}: no sha1 in {status_url} nor {sums_url}; cannot verify it")
        if name in sums and sums[name] != sha1:
            raise ChecksumError(
                f"{name}: dumpstatus.json says sha1 {sha1} but {sums_url} says {sums[name]}; "
                "the dump site is inconsistent, try again later or another date"
            )
        url = info.get("url") or f"/{lang}wiki/{date}/{name}"
        files.append(DumpFile(name, base_url(base) + url if url.startswith("/") else url,
                              info.get("size"), sha1))
    if not files:
        raise DownloadError(f"{status_url}: job {job} lists no files")
    return files


def sha1_file(uri: str | Path) -> str:
    digest = hashlib.sha1()
    with storage.open_file(str(uri), "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_whole(uri: str, name: str) -> None:
    """Refuse a ``.bz2`` file that does not end as a bz2 stream ends: a sha1 taken of a cut file
    matches it, so only the file's own end tells."""
    from bert_core.corpus.bz2_blocks import ends_whole

    if not name.endswith(".bz2"):
        return
    with storage.open_file(uri, "rb") as f:
        if ends_whole(f):
            return
    raise CutFileError(
        f"{name}: the file is cut short ({storage.size(uri):,} bytes, no bz2 end-of-stream marker) "
        "although its sha1 matches the dump site's listing; the site serves it cut: try another "
        "--date or a mirror (--base-url)")


def fetch_resumable(
    url: str,
    part: Path,
    *,
    size: int | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    timeout: float = 60,
    log: Callable[[str], None] = lambda m: None,
) -> Path:
    """Download ``url`` into ``part``, continuing from the bytes already there (HTTP Range)."""
    attempt = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if size is not None and have >= size:
            return part
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                if have and resp.status != 206:  # the server ignored Range: start again
                    log(f"{url}: server does not resume, restarting from byte 0")
                    have = 0
                with open(part, "ab" if have else "wb") as out:
                    while block := resp.read(_CHUNK):
                        out.write(block)
                expected = resp.headers.get("Content-Length")
            got = part.stat().st_size - have
            if expected is not None and got < int(expected):
                raise http.client.IncompleteRead(b"", int(expected) - got)
            return part
        except urllib.error.HTTPError as err:
            if err.code == 416 and have:  # asked past the end: the part is already whole
                return part
            if not is_infrastructure_error(err):
                raise DownloadError(f"GET {url}: HTTP {err.code}") from None
            reason: object = f"HTTP {err.code}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            if not is_infrastructure_error(err):  # a full disk, say: a retry fails the same way
                raise
            reason = err
        attempt += 1
        if attempt > retries:
            have = part.stat().st_size if part.exists() else 0
            raise TransferError(
                f"GET {url}: gave up after {retries} retries ({reason}); {have} bytes kept in "
                f"{part}: run the same command again to resume"
            )
        log(f"{url}: transfer broke ({reason}); resuming (retry {attempt}/{retries})")
        time.sleep(backoff * attempt)


def download_wikipedia(
    lang: str,
    date: str,
    to: str,
    *,
    job: str = "articlesdump",
    base: str | None = None,
    staging: str | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    log: Callable[[str], None] = lambda m: None,
) -> dict:
    """Download and verify every file of a dump job into folder ``to``; returns the manifest.

    Partial files live in ``staging`` (default: :func:`staging_dir` of ``to``), so running the
    same command again resumes them. The attempt holds the lease of ``to`` while it writes: a
    second download of the same destination waits, then reuses what the first one finished.

    A finished file is not fetched again. ``_MANIFEST.json`` (stage ``download``) is written last.
    """
    wanted = {"source": "wikipedia", "lang": lang, "date": date, "job": job}
    if (done := reusable(to, "download", wanted)) is not None:
        log(f"{storage.to_uri(to)}: already downloaded and verified")
        return done
    files = list_dump_files(lang, date, job=job, base=base)
    stage_dir = Path(staging) if staging else staging_dir(to, f"{lang}wiki-{date}")
    try:
        with lease.hold(to, "download") as held:
            if (done := reusable(to, "download", wanted)) is not None:
                log(f"{storage.to_uri(to)}: downloaded by another run meanwhile; verified")
                return done
            stage_dir.mkdir(parents=True, exist_ok=True)
            shards = _fetch_dump_files(files, to, stage_dir, retries=retries, backoff=backoff, log=log)
            held.check()
            manifest = storage.write_manifest(
                to, fence=lease.fence(to, held.attempt),
                stage="download",
                config={**wanted, "base_url": base_url(base)},
                shards=shards,
                counts={"files": len(shards), "bytes": sum(s["bytes"] for s in shards)},
            )
    finally:
        if not staging:  # a part kept for the next run keeps its folder
            drop_if_empty(stage_dir)
        if not storage.has_manifest(to):
            drop_if_empty(to)
    return manifest


def _fetch_dump_files(files: list[DumpFile], to: str, stage_dir: Path, *, retries: int,
                      backoff: float, log: Callable[[str], None]) -> list[dict]:
    """Each file of ``files`` fetched, verified and moved into ``to``; their manifest rows."""
    shards = []
    for f in files:
        dest = storage.join(to, f.name)
        # A file at its destination was verified before it was moved there; re-check cheaply.
        if storage.exists(dest) and f.size in (None, storage.size(dest)) and sha1_file(dest) == f.sha1:
            check_whole(dest, f.name)
            log(f"{f.name}: already downloaded and verified")
            shards.append(storage.shard_entry(dest, sha1=f.sha1))
            continue
        part = stage_dir / (f.name + ".part")
        log(f"{f.name}: downloading {f.url}")
        fetch_resumable(f.url, part, size=f.size, retries=retries, backoff=backoff, log=log)
        actual = sha1_file(part)
        if actual != f.sha1:
            part.unlink()  # a corrupt part must not be resumed from
            raise ChecksumError(
                f"{f.name}: sha1 {actual} does not match the dump site's {f.sha1}; the partial "
                "file was deleted, run the command again to download it afresh"
            )
        try:
            check_whole(str(part), f.name)
        except CutFileError:
            part.unlink()
            raise
        publish(part, dest)
        shards.append(storage.shard_entry(dest, sha1=f.sha1))
        log(f"{f.name}: verified (sha1 {f.sha1})")
    return shards


def publish(part: Path, dest: str) -> None:
    """Move a verified file to its destination (rename locally, upload to object stores)."""
    if storage.is_local(dest):
        target = Path(storage.to_uri(dest))
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, target)
        return
    storage.copy_file(str(part), dest, _CHUNK)
    part.unlink()
