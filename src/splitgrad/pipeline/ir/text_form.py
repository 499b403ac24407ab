"""The fields of :meth:`Schedule.to_text <splitgrad.pipeline.Schedule.to_text>`'s line-oriented form, read
back (golden files, debugging). Torch-free; action names stay text here (``Schedule.from_text`` parses them).
"""

from __future__ import annotations

__all__ = ["parse_schedule_text"]

_FIELDS = ("schedule", "stages", "microbatches", "stage_to_rank")


def parse_schedule_text(text: str) -> tuple[str, int, tuple[int, ...], list[list[str]]]:
    """Split a schedule's text form into its fields.

    Returns:
        ``(name, n_microbatches, stage_to_rank, rank_lines)``; ``rank_lines[r]`` is rank ``r``'s action names.

    Raises:
        ValueError: an unknown field or a malformed rank line (naming the line), missing fields, a
            ``stage_to_rank`` whose length disagrees with ``stages``, or rank lines not numbered ``0..n-1``.
    """
    fields: dict[str, str] = {}
    ranks: dict[int, list[str]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        if key == "rank":
            index, sep, body = value.partition(":")
            if not sep or not index.strip().isdigit():
                raise ValueError(f"line {lineno}: expected 'rank <r>: <actions>', got {raw!r}")
            ranks[int(index)] = body.split()
        elif key in _FIELDS:
            fields[key] = value.strip()
        else:
            raise ValueError(f"line {lineno}: unknown field {key!r} in {raw!r}")
    missing = [k for k in _FIELDS if k not in fields]
    if missing:
        raise ValueError(f"schedule text lacks fields {missing}")
    stage_to_rank = tuple(int(tok) for tok in fields["stage_to_rank"].split())
    if len(stage_to_rank) != int(fields["stages"]):
        raise ValueError(f"'stages {fields['stages']}' disagrees with {len(stage_to_rank)=} entries")
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"rank lines must be numbered 0..n-1, got {sorted(ranks)}")
    return (
        fields["schedule"],
        int(fields["microbatches"]),
        stage_to_rank,
        [ranks[r] for r in range(len(ranks))],
    )
