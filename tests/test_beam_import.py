"""Beam is imported without the clients of connectors the jobs never use, and a runner of other
machines gets them back."""

import subprocess
import sys

from beam_jobs.beam_import import SKIPPED


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_jobs_import_beam_without_the_skipped_clients_and_say_nothing_of_them():
    code = ("import sys, beam_jobs.clean_corpus\n"
            f"print(sorted(m for m in sys.modules if m.startswith({SKIPPED!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert done.stderr == ""  # no warning of a connector skipped


def test_the_skipped_clients_import_afterwards_and_beam_finds_gcs_once_restored():
    out = _python("import beam_jobs.job\n"
                  "from apache_beam.io.filesystems import FileSystems\n"
                  "try:\n    FileSystems.get_filesystem('gs://bucket/x')\nexcept ValueError:\n    print('none')\n"
                  "import google.cloud.storage, pymongo\n"
                  "from beam_jobs.beam_import import connectors_restored\n"
                  "connectors_restored()\n"
                  "print(type(FileSystems.get_filesystem('gs://bucket/x')).__name__)")
    assert out.splitlines() == ["none", "GCSFileSystem"]


def test_beam_imported_first_is_left_as_it_is():
    out = _python("import sys, apache_beam, beam_jobs.job\n"
                  "print('google.cloud.storage' in sys.modules)")
    assert out == "True"
