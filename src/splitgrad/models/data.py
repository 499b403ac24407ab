"""A tiny character-level corpus for the demo: Python standard-library source already on the machine.

Nothing is downloaded. :func:`stdlib_text` reads ``*.py`` files of the running interpreter's standard library
in a fixed order (sorted paths: top-level modules first, then packages, skipping tests and ``site-packages``)
up to a character budget, so the same interpreter always yields the same text. :class:`CharTokenizer` maps
characters to ids; :class:`TokenDataset` serves ``(inputs, targets)`` next-token batches.
"""

from __future__ import annotations

import logging
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CharCorpus", "CharTokenizer", "TokenDataset", "load_char_corpus", "stdlib_text"]

logger = logging.getLogger(__name__)

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def _stdlib_files(root: Path) -> Iterator[Path]:
    """``*.py`` under ``root`` in a deterministic order: top-level files, then the rest, each sorted."""
    yield from sorted(root.glob("*.py"))
    nested = (p for p in root.rglob("*.py") if p.parent != root)
    yield from sorted(p for p in nested if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def stdlib_text(max_chars: int = 1_000_000, *, root: str | Path | None = None) -> str:
    """Up to ``max_chars`` characters of Python source, files joined by a newline.

    Args:
        max_chars: character budget (> 0); reading stops as soon as it is reached.
        root: directory to read; default ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        The text (exactly ``max_chars`` long unless the directory holds less).
    """
    if max_chars <= 0:
        raise ValueError(f"stdlib_text: max_chars must be positive, got {max_chars=}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib_text: {str(base)!r} is not a directory")
    parts, size = [], 0
    for path in _stdlib_files(base):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:  # unreadable file: skip it, the order of the others is unchanged
            logger.debug("stdlib_text: skipping %s (%s)", path, exc)
            continue
        parts.append(text + "\n")
        size += len(text) + 1
        if size >= max_chars:
            break
    if not parts:
        raise FileNotFoundError(f"stdlib_text: no readable *.py files under {str(base)!r}")
    return "".join(parts)[:max_chars]


class CharTokenizer:
    """Bijection between the characters of an alphabet and ids ``0 .. vocab_size - 1`` (sorted by code point).

    Args:
        alphabet: the characters to know (duplicates ignored).
    """

    def __init__(self, alphabet: str) -> None:
        chars = sorted(set(alphabet))
        if not chars:
            raise ValueError("CharTokenizer: the alphabet is empty")
        self.chars = "".join(chars)
        codes = torch.tensor([ord(c) for c in chars], dtype=torch.long)
        # Code point -> id lookup table (-1: unknown), so encoding is one gather instead of a Python loop.
        self._table = torch.full((int(codes.max()) + 1,), -1, dtype=torch.long)
        self._table[codes] = torch.arange(len(chars))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose alphabet is every character of ``text``."""
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> ids ``(len(text),)`` int64; raises ``ValueError`` naming any unknown characters."""
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        known = codes < self._table.numel()
        ids = torch.where(known, self._table[codes.clamp(max=self._table.numel() - 1)], -1)
        if (ids < 0).any():
            unknown = sorted({text[i] for i in (ids < 0).nonzero().flatten().tolist()[:100]})
            raise ValueError(f"CharTokenizer: characters outside the alphabet: {unknown!r}")
        return ids

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """ids (any shape, flattened) -> text."""
        flat = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in flat if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"CharTokenizer: ids out of range [0, {self.vocab_size}): {bad[:10]}")
        return "".join(self.chars[i] for i in flat)


class TokenDataset:
    """Next-token windows over a 1-D token stream.

    Args:
        tokens: ``(N,)`` int64 ids.
        seq_len: window length; a sample is ``tokens[i : i + seq_len]`` with targets shifted by one.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.long:
            raise ValueError(
                f"TokenDataset: tokens must be 1-D int64, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if seq_len <= 0 or tokens.numel() <= seq_len:
            raise ValueError(
                f"TokenDataset: need 0 < seq_len < len(tokens), got {seq_len=} len={tokens.numel()}"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        """Number of distinct windows."""
        return self.tokens.numel() - self.seq_len

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[starts.unsqueeze(1) + torch.arange(self.seq_len + 1)]
        return chunk[:, :-1], chunk[:, 1:]

    def get_batch(
        self, batch_size: int, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of random windows (uniform start positions drawn from ``generator``).

        Returns:
            ``(inputs, targets)``, both ``(batch_size, seq_len)`` int64 on the CPU; ``targets`` is ``inputs``
            shifted left by one token.
        """
        if batch_size <= 0:
            raise ValueError(f"TokenDataset.get_batch: batch_size must be positive, got {batch_size=}")
        return self._windows(torch.randint(0, len(self), (batch_size,), generator=generator))

    def batches(
        self, batch_size: int, n_batches: int, *, seed: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` random batches from a generator seeded with ``seed`` (reproducible)."""
        generator = torch.Generator().manual_seed(seed)
        for _ in range(n_batches):
            yield self.get_batch(batch_size, generator=generator)

    def eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows in order (the last partial batch included), for a deterministic eval loss."""
        starts = torch.arange(0, len(self), self.seq_len)
        for chunk in starts.split(batch_size):
            yield self._windows(chunk)


@dataclass(kw_only=True, slots=True)
class CharCorpus:
    """What :func:`load_char_corpus` returns."""

    tokenizer: CharTokenizer
    """Built from the whole text, so validation never meets an unknown character."""
    train: TokenDataset
    """The first ``1 - val_fraction`` of the text."""
    val: TokenDataset
    """The rest."""


def load_char_corpus(
    seq_len: int, *, max_chars: int = 1_000_000, val_fraction: float = 0.1, root: str | Path | None = None
) -> CharCorpus:
    """Read :func:`stdlib_text`, build a :class:`CharTokenizer`, split into train/validation streams.

    Args:
        seq_len: window length of both datasets (use the model's ``seq_len``).
        max_chars: character budget of the text.
        val_fraction: share of the text (its tail) held out, in ``(0, 1)``.
        root: directory of ``*.py`` files (default: the standard library).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"load_char_corpus: val_fraction must be in (0, 1), got {val_fraction=}")
    text = stdlib_text(max_chars, root=root)
    tokenizer = CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    cut = int(len(ids) * (1.0 - val_fraction))
    if min(cut, len(ids) - cut) <= seq_len:
        raise ValueError(
            f"load_char_corpus: {len(ids)} characters are too few for {seq_len=} with {val_fraction=}; "
            "raise max_chars"
        )
    logger.info("char corpus: %d characters, vocabulary of %d", len(ids), tokenizer.vocab_size)
    return CharCorpus(
        tokenizer=tokenizer, train=TokenDataset(ids[:cut], seq_len), val=TokenDataset(ids[cut:], seq_len)
    )
