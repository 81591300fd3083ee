"""Entity (chunk) level precision / recall / F1 exactly as CoNLL's ``conlleval.pl``.

A line-by-line port of the official Perl script's chunk logic, quirks included.
:func:`report` prints the script's own text.

    python -m bert_core.finetune.conlleval < ground_truth.txt   # same output as conlleval.pl
    python -m bert_core.finetune.conlleval ground_truth.txt     # the same, naming the file in errors
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bert_core.finetune.errors import TaskDataError

BOUNDARY = "-X-"


def _split_tag(tag: str) -> tuple[str, str]:
    # Perl: /^([^-]*)-(.*)$/ -> prefix before the first '-', type after it.
    if "-" in tag:
        prefix, chunk_type = tag.split("-", 1)
        return prefix, chunk_type
    return tag, ""


def end_of_chunk(prev_tag: str, tag: str, prev_type: str, chunk_type: str) -> bool:
    """True when the chunk open at the token before ends at the current token."""
    return (
        (prev_tag, tag) in {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O"),
                            ("E", "E"), ("E", "I"), ("E", "O")}
        or (prev_tag not in ("O", ".") and prev_type != chunk_type)
        or prev_tag in ("]", "[")
    )


def start_of_chunk(prev_tag: str, tag: str, prev_type: str, chunk_type: str) -> bool:
    """True when a chunk starts at this token."""
    return (
        (prev_tag, tag) in {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I"),
                            ("E", "E"), ("E", "I"), ("O", "E")}
        or (tag not in ("O", ".") and prev_type != chunk_type)
        or tag in ("[", "]")
    )


@dataclass
class Counts:
    """What conlleval.pl counts: chunks found/guessed/correct overall and per type, tag accuracy."""

    correct_chunk: int = 0
    found_correct: int = 0
    found_guessed: int = 0
    correct_tags: int = 0
    token_counter: int = 0
    t_correct_chunk: Counter = field(default_factory=Counter)
    t_found_correct: Counter = field(default_factory=Counter)
    t_found_guessed: Counter = field(default_factory=Counter)


def count_chunks(rows: Iterable[tuple[str, str, str]]) -> Counts:
    """Count over ``(first_item, gold_tag, guessed_tag)`` rows; a sentence break is ``("-X-", "O", "O")``.

    The script's ``startOfChunk`` / ``endOfChunk`` over IOB1, IOB2, IOBES and bracket tags,
    quirks included: a chunk counts as correct only if gold and guess start and end on the same
    tokens with the same type, and an ``I-`` after ``O`` opens a chunk.
    """
    c = Counts()
    in_correct = False
    last_correct, last_correct_type = "O", ""
    last_guessed, last_guessed_type = "O", ""
    for first_item, gold, guess in rows:
        correct, correct_type = _split_tag(gold)
        guessed, guessed_type = _split_tag(guess)
        if first_item == BOUNDARY:
            guessed = "O"
        gold_end = end_of_chunk(last_correct, correct, last_correct_type, correct_type)
        guess_end = end_of_chunk(last_guessed, guessed, last_guessed_type, guessed_type)
        if in_correct:
            if gold_end and guess_end and last_guessed_type == last_correct_type:
                in_correct = False
                c.correct_chunk += 1
                c.t_correct_chunk[last_correct_type] += 1
            elif gold_end != guess_end or guessed_type != correct_type:
                in_correct = False
        gold_start = start_of_chunk(last_correct, correct, last_correct_type, correct_type)
        guess_start = start_of_chunk(last_guessed, guessed, last_guessed_type, guessed_type)
        if gold_start and guess_start and guessed_type == correct_type:
            in_correct = True
        if gold_start:
            c.found_correct += 1
            c.t_found_correct[correct_type] += 1
        if guess_start:
            c.found_guessed += 1
            c.t_found_guessed[guessed_type] += 1
        if first_item != BOUNDARY:
            if correct == guessed and guessed_type == correct_type:
                c.correct_tags += 1
            c.token_counter += 1
        last_guessed, last_correct = guessed, correct
        last_guessed_type, last_correct_type = guessed_type, correct_type
    if in_correct:
        c.correct_chunk += 1
        c.t_correct_chunk[last_correct_type] += 1
    return c


def _prf(correct: int, guessed: int, gold: int) -> tuple[float, float, float]:
    precision = 100 * correct / guessed if guessed > 0 else 0.0
    recall = 100 * correct / gold if gold > 0 else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f1


def split_fields(line: str, delimiter: str | None = " ") -> list[str]:
    """Perl's ``split(/$delimiter/, $line)``: the fields, trailing empty ones dropped."""
    features = line.removesuffix("\n").split(delimiter)
    while features and features[-1] == "":
        features.pop()
    return features


def rows_from_lines(
    lines: Iterable[str], delimiter: str | None = None, source: str = "input"
) -> list[tuple[str, str, str]]:
    """Parse conlleval input: tokens with features, gold tag second-to-last, guess last.

    ``source`` names the input in errors (a file name, or ``stdin``).

    Lines are read as the script reads them: fields split on the delimiter, trailing empty
    fields dropped (Perl's ``split``), so a trailing space on a token line changes nothing. Input
    with Windows (CR LF) line endings is refused with one line naming it: ``conlleval.pl`` stops on
    it (its blank lines keep the CR and count as one-column lines) or, without blank lines, reads
    every guessed tag with a CR attached.
    """
    rows = []
    n_features = None
    for number, line in enumerate(lines, 1):
        if line.removesuffix("\n").endswith("\r"):
            name = "FILE" if source == "stdin" else source
            raise TaskDataError(
                f"{source}: line {number} ends in CR LF (Windows line endings), which conlleval.pl "
                f"refuses; convert the file to LF line endings (dos2unix {name}) and run again"
            )
        features = split_fields(line, delimiter)
        if features and n_features is None:
            n_features = len(features)
        elif features and len(features) != n_features:
            raise TaskDataError(
                f"{source}: line {number} has {len(features)} columns where earlier lines have "
                f"{n_features}; every token line needs the same columns (token ... gold guess)"
            )
        if not features or features[0] == BOUNDARY:
            rows.append((BOUNDARY, "O", "O"))
            continue
        if len(features) < 2:
            raise TaskDataError(f"{source}: line {number} {line.rstrip()!r} needs at least a gold and a "
                             "guessed tag after the token")
        rows.append((features[0], features[-2], features[-1]))
    return rows


def rows_from_sequences(
    gold: Sequence[Sequence[str]], guessed: Sequence[Sequence[str]]
) -> list[tuple[str, str, str]]:
    """Sentences of tags -> conlleval rows, one boundary after each sentence."""
    rows = []
    for i, (g, p) in enumerate(zip(gold, guessed, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} guessed tags")
        rows.extend(("tok", a, b) for a, b in zip(g, p, strict=True))
        rows.append((BOUNDARY, "O", "O"))
    return rows


def evaluate(gold: Sequence[Sequence[str]], guessed: Sequence[Sequence[str]]) -> dict:
    """Overall and per-type precision/recall/F1 (percent) of sentences of tags."""
    return summarize(count_chunks(rows_from_sequences(gold, guessed)))


def summarize(c: Counts) -> dict:
    precision, recall, f1 = _prf(c.correct_chunk, c.found_guessed, c.found_correct)
    per_type = {}
    for t in sorted(set(c.t_found_correct) | set(c.t_found_guessed)):
        p, r, f = _prf(c.t_correct_chunk[t], c.t_found_guessed[t], c.t_found_correct[t])
        per_type[t] = {"precision": p, "recall": r, "f1": f, "found": c.t_found_guessed[t]}
    return {
        "precision": precision, "recall": recall, "f1": f1,
        "accuracy": 100 * c.correct_tags / c.token_counter if c.token_counter else 0.0,
        "tokens": c.token_counter, "phrases": c.found_correct, "found": c.found_guessed,
        "correct": c.correct_chunk, "per_type": per_type,
    }


def report(c: Counts) -> str:
    """The text conlleval.pl prints (non-LaTeX mode)."""
    s = summarize(c)
    out = [
        f"processed {c.token_counter} tokens with {c.found_correct} phrases; "
        f"found: {c.found_guessed} phrases; correct: {c.correct_chunk}.\n"
    ]
    if c.token_counter > 0:
        out.append(
            f"accuracy: {s['accuracy']:6.2f}%; precision: {s['precision']:6.2f}%; "
            f"recall: {s['recall']:6.2f}%; FB1: {s['f1']:6.2f}\n"
        )
    for t, v in s["per_type"].items():
        out.append(
            f"{t:>17}: precision: {v['precision']:6.2f}%; recall: {v['recall']:6.2f}%; "
            f"FB1: {v['f1']:6.2f}  {v['found']}\n"
        )
    return "".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``conlleval [FILE]``: print the script's report; a bad input is one line and exit 1."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) > 1:
        sys.stderr.write("conlleval: give one file, or the input on stdin\n")
        return 2
    try:
        if args:
            # newline="" keeps CR LF as it is, so such a file is refused as conlleval.pl refuses it.
            with open(args[0], encoding="utf-8", newline="") as f:
                rows = rows_from_lines(f, delimiter=" ", source=args[0])
        else:
            rows = rows_from_lines(sys.stdin, delimiter=" ", source="stdin")
    except (OSError, ValueError) as err:
        why = f"{args[0]}: {err.strerror}" if isinstance(err, OSError) and err.strerror else err
        sys.stderr.write(f"conlleval: {why}\n")
        return 1
    sys.stdout.write(report(count_chunks(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
