"""The character corpus: deterministic reading of local source files, the tokenizer, and the batches.

Why: the demo trains the GPT on this data and compares runs (pipelined vs not); that needs the same text,
the same ids and the same batches every time, with no network. Tests read only a few thousand characters.
"""

from __future__ import annotations

import pytest
import torch

from splitgrad.models import CharTokenizer, TokenDataset, load_char_corpus, stdlib_text


def test_stdlib_text_is_bounded_and_deterministic():
    text = stdlib_text(5_000)
    assert len(text) == 5_000
    assert text == stdlib_text(5_000)
    assert "import" in text or "def " in text, "expected Python source"


def test_file_order_and_skipped_directories(tmp_path):
    (tmp_path / "b.py").write_text("B")
    (tmp_path / "a.py").write_text("A")
    (tmp_path / "notes.txt").write_text("not python")
    for sub, body in [("pkg", "P"), ("test", "T"), ("site-packages", "S"), ("pkg/tests", "U")]:
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "m.py").write_text(body)
    assert stdlib_text(100, root=tmp_path) == "A\nB\nP\n"
    assert stdlib_text(3, root=tmp_path) == "A\nB"
    with pytest.raises(FileNotFoundError, match="not a directory"):
        stdlib_text(10, root=tmp_path / "missing")
    with pytest.raises(ValueError, match="max_chars"):
        stdlib_text(0, root=tmp_path)


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer.from_text("hello, wörld\n")
    assert tok.chars == "".join(sorted(set("hello, wörld\n")))
    ids = tok.encode("world hello\n")
    assert ids.dtype == torch.long and ids.shape == (12,)
    assert tok.decode(ids) == "world hello\n"
    assert tok.encode("ö").item() == tok.vocab_size - 1
    with pytest.raises(ValueError, match=r"\['x', 'z'\]"):
        tok.encode("hex z")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_batches_are_shifted_windows_of_the_stream():
    tokens = torch.arange(100)
    data = TokenDataset(tokens, seq_len=8)
    inputs, targets = data.get_batch(5, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (5, 8)
    # arange tokens: each row must be consecutive, targets one ahead.
    torch.testing.assert_close(inputs[:, 1:] - inputs[:, :-1], torch.ones(5, 7, dtype=torch.long))
    torch.testing.assert_close(targets, inputs + 1)
    first = [b[0] for b in data.batches(2, 3, seed=7)]
    again = [b[0] for b in data.batches(2, 3, seed=7)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    evals = list(data.eval_batches(4))
    assert torch.equal(torch.cat([x for x, _ in evals])[:, 0], torch.arange(0, 92, 8))
    with pytest.raises(ValueError, match="seq_len=100"):
        TokenDataset(tokens, seq_len=100)


def test_load_char_corpus_splits_train_and_validation():
    corpus = load_char_corpus(16, max_chars=20_000, val_fraction=0.25)
    assert corpus.train.tokens.numel() == 15_000 and corpus.val.tokens.numel() == 5_000
    assert int(corpus.train.tokens.max()) < corpus.tokenizer.vocab_size
    assert corpus.tokenizer.decode(corpus.val.tokens[:50]) == stdlib_text(20_000)[15_000:15_050]
    with pytest.raises(ValueError, match="too few"):
        load_char_corpus(16, max_chars=40)
