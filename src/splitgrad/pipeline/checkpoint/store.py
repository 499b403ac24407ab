"""Where checkpoints live on disk, and how only complete ones become visible.

A checkpoint of step ``k`` under ``root`` is the folder ``root/step_{k:08d}``. It is written under a temporary
name (``step_{k:08d}.tmp-<nonce>``) by every rank (torch.distributed.checkpoint: one ``.distcp`` file per rank,
then ``.metadata`` from the coordinator once every rank's writes are done); then rank 0 adds the marker
``splitgrad_checkpoint.json`` (the step, the partition, the rank layout, and the size of every file) and
renames the folder to its final name, one atomic ``rename`` on a POSIX filesystem. A writer killed at any
point leaves a ``.tmp-`` folder, which nothing loads (and the next checkpointer removes); a final-named folder
is only trusted when its marker is there and every file it lists has its size (:func:`verify_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "MARKER",
    "IncompleteCheckpointError",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "publish",
    "remove_unpublished",
    "temporary_path",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

MARKER = "splitgrad_checkpoint.json"
"""The file whose presence (with matching file sizes) makes a checkpoint folder complete."""
FORMAT = 1
"""Version of the marker's content; a checkpoint of another version is refused."""
_FINAL = re.compile(r"^step_(\d{8,})$")
_TEMPORARY = re.compile(r"^step_\d{8,}\.(tmp|old)-[0-9a-f]+$")


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint folder that was never published, or whose files do not match its marker."""


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """``root/step_{step:08d}``: where the checkpoint of ``step`` is published."""
    if step < 0:
        raise ValueError(f"checkpoint_path: step must be >= 0, got {step=}")
    return Path(root) / f"step_{step:08d}"


def temporary_path(root: str | os.PathLike, step: int, nonce: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is published (``nonce``: the same on every rank)."""
    return checkpoint_path(root, step).with_name(f"step_{step:08d}.tmp-{nonce:x}")


def publish(temporary: Path, final: Path, marker: dict[str, Any]) -> None:
    """Make the written folder ``temporary`` the checkpoint ``final`` (rank 0, after every rank wrote).

    The marker is written and synced inside the folder first, then the folder is renamed. A checkpoint of the
    same step already published (a job that was restarted and reached that step again) is moved aside first
    and removed after; in between, the older checkpoints stay visible.
    """
    files = {p.name: p.stat().st_size for p in sorted(temporary.iterdir()) if p.is_file()}
    content = json.dumps({**marker, "format": FORMAT, "files": files}, indent=1, sort_keys=True)
    marker_tmp = temporary / f".{MARKER}.partial"
    with open(marker_tmp, "w") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker_tmp, temporary / MARKER)
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{temporary.name.rsplit('-', 1)[-1]}")
        os.rename(final, aside)
    os.rename(temporary, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    # The rename is durable once the parent folder's entry is synced (not possible on every platform).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The marker of the complete checkpoint at ``path``.

    Raises:
        IncompleteCheckpointError: ``path`` is a temporary folder, has no marker (never published), a marker
            of another format, or a file the marker lists is missing or has another size (the message names
            it).
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist (or is not a folder)")
    if _TEMPORARY.match(path.name):
        raise IncompleteCheckpointError(
            f"checkpoint {str(path)!r} is a folder being written (or left by a writer that died): never loaded"
        )
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"checkpoint {str(path)!r} has no {MARKER}: it was never published complete, so it is not loaded"
        ) from None
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(f"checkpoint {str(path)!r}: unreadable {MARKER} ({exc})") from None
    if marker.get("format") != FORMAT:
        raise IncompleteCheckpointError(
            f"checkpoint {str(path)!r}: {MARKER} has format {marker.get('format')!r}, this splitgrad reads {FORMAT}"
        )
    for name, size in marker["files"].items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise IncompleteCheckpointError(
                f"checkpoint {str(path)!r}: {name} is {found}, its marker recorded {size} bytes; not loaded"
            )
    return marker


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every folder under ``root`` named like a published checkpoint, newest first
    (complete or not: see :func:`verify_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _FINAL.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None. Incomplete folders are skipped with a warning."""
    for _, path in list_checkpoints(root):
        try:
            verify_checkpoint(path)
        except IncompleteCheckpointError as exc:
            logger.warning("skipping %s", exc)
            continue
        return path
    return None


def remove_unpublished(root: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders writers left under ``root`` (call it only when no save is under way)."""
    root = Path(root)
    removed = [p for p in root.iterdir() if _TEMPORARY.match(p.name)] if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.info("removed %d unfinished checkpoint folder(s) under %s", len(removed), root)
    return removed
