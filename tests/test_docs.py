"""Every code block in README.md, CONTRIBUTING.md and docs/*.md runs as written.

Why: documentation is the newcomer's first program. A ```python block runs in a fresh namespace in a scratch
directory; one preceded by ``<!-- run: ranks=N -->`` runs as a script under ``torchrun --nproc-per-node N``
(what its ``dist.init_process_group`` expects) and must leave no gloo worker thread alive after its last line
(``tests/doc_exit_probe.py``, appended to it); ``<!-- not-run: reason -->`` skips a block, with the reason
shown and the skips counted. In ```bash blocks, every ``python -m splitgrad ...`` command must parse (cheap
``schedule`` commands run for real), every ``make`` target must exist, and every benchmark script must exist
and accept the flags shown. A fence without a language fails: output and pseudo-code are tagged ``text``.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}
MAX_NOT_RUN = 2  # exclusions stay rare; raising this needs a reason in the docs *and* a review
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(run|not-run):(.*?)-->\s*$")
_EXIT_PROBE = (Path(__file__).parent / "doc_exit_probe.py").read_text()


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts, its language, its text and the marker comment above it."""

    path: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"

    @property
    def ranks(self) -> int:
        """World size asked for by ``<!-- run: ranks=N -->``; 0 for a block run in-process."""
        if self.marker is None or self.marker[0] != "run":
            return 0
        match = re.fullmatch(r"\s*ranks=(\d+)\s*", self.marker[1])
        if match is None:
            raise ValueError(
                f"{self.where}: malformed marker 'run:{self.marker[1]}' (expected 'run: ranks=N')"
            )
        return int(match.group(1))


def extract_blocks(text: str, path: Path) -> list[Block]:
    """Fenced blocks of a markdown text, each with the marker comment on the closest non-blank line above."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{start + 1}: code block never closed")
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above.strip())
        blocks.append(
            Block(
                path=path,
                line=start + 1,
                lang=opened.group(1),
                code="\n".join(lines[start + 1 : end]) + "\n",
                marker=(marker.group(1), marker.group(2).strip()) if marker else None,
            )
        )
        i = end + 1
    return blocks


def run_python_block(block: Block, workdir: Path) -> None:
    """Run one python block as its marker says; raise ``RuntimeError`` naming the block if it fails."""
    if block.marker is not None and block.marker[0] == "not-run":
        raise ValueError(f"{block.where} is marked not-run")
    if block.ranks == 0:
        code = compile(block.code, block.where, "exec")  # tracebacks name the doc and line
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            exec(code, {"__name__": "__main__"})
        except Exception as exc:
            raise RuntimeError(f"{block.where} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            os.chdir(cwd)
        return
    script = workdir / "block.py"
    script.write_text(block.code + _exit_probe(block))
    proc = run_torchrun([str(script)], ranks=block.ranks, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{block.where} failed under torchrun (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )


def _exit_probe(block: Block) -> str:
    """The end-of-block check appended to a multi-rank block (after its last line, so its line numbers hold)."""
    probe = _EXIT_PROBE[_EXIT_PROBE.index("def _splitgrad_doc_exit_probe") :]
    return (
        f"\n\n# --- appended by tests/test_docs.py ---\n{probe}\n_splitgrad_doc_exit_probe({block.where!r})\n"
    )


def _all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in extract_blocks(path.read_text(), path)]


BLOCKS = _all_blocks()
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python" and (b.marker is None or b.marker[0] == "run")]


def test_every_block_has_a_known_language_and_exclusions_are_rare_and_explained():
    untagged = [f"{b.where} ({b.lang or 'no language'})" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not untagged, f"tag every fence with one of {sorted(LANGUAGES)}: {untagged}"
    skipped = [b for b in BLOCKS if b.marker is not None and b.marker[0] == "not-run"]
    assert all(b.marker[1] for b in skipped), [b.where for b in skipped if not b.marker[1]]
    assert len(skipped) <= MAX_NOT_RUN, [f"{b.where}: {b.marker[1]}" for b in skipped]
    assert all(b.lang == "python" for b in BLOCKS if b.marker is not None), "markers apply to python blocks"
    assert len(PYTHON_BLOCKS) >= 15  # the docs' examples are all collected (a parser bug would drop them)


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.where, marks=[pytest.mark.distributed] if b.ranks else []) for b in PYTHON_BLOCKS],
)
def test_python_block_runs(block, tmp_path):
    run_python_block(block, tmp_path)


# --- the runner itself can fail -----------------------------------------------------------------------------

_SAMPLE = """\
text

```python
x = 1
assert x == 1
```

<!-- not-run: needs 16 machines -->
```python
raise SystemError("never run")
```

```python
undefined_name + 1
```

```
untagged
```
"""


def test_the_runner_rejects_a_failing_block_and_honours_markers(tmp_path):
    ok, skipped, failing, untagged = extract_blocks(_SAMPLE, tmp_path / "sample.md")
    run_python_block(ok, tmp_path)
    assert skipped.marker == ("not-run", "needs 16 machines")
    with pytest.raises(ValueError, match="marked not-run"):
        run_python_block(skipped, tmp_path)
    with pytest.raises(RuntimeError, match=r"sample\.md:13 failed: NameError"):
        run_python_block(failing, tmp_path)
    assert untagged.lang == ""
    with pytest.raises(ValueError, match="never closed"):
        extract_blocks("```python\nx = 1\n", tmp_path / "open.md")


@pytest.mark.distributed
def test_the_runner_rejects_a_block_failing_on_one_rank(tmp_path):
    block = Block(
        tmp_path / "ranks.md",
        3,
        "python",
        'import os\nif os.environ["RANK"] == "1":\n    raise ValueError("rank 1 broke")\n',
        ("run", "ranks=2"),
    )
    with pytest.raises(RuntimeError, match=r"(?s)ranks\.md:3 failed under torchrun.*rank 1 broke"):
        run_python_block(block, tmp_path)


@pytest.mark.distributed
def test_the_runner_rejects_a_block_leaving_a_gloo_worker_alive(tmp_path):
    # A group the script keeps in a variable outlives destroy_process_group(): its gloo workers would run into
    # interpreter shutdown (docs/parallel.md, "A crash at exit"). The same block without it passes (below).
    code = (
        'import torch.distributed as dist\ndist.init_process_group("gloo")\nkept = dist.new_group([0, 1])\n'
        "dist.destroy_process_group()\n"
    )
    block = Block(tmp_path / "held.md", 5, "python", code, ("run", "ranks=2"))
    with pytest.raises(
        RuntimeError, match=r"(?s)held\.md:5: [1-9][0-9]* gloo worker thread\(s\) alive after the block's"
    ):
        run_python_block(block, tmp_path)
    run_python_block(
        Block(tmp_path / "held.md", 5, "python", code.replace("kept = ", ""), ("run", "ranks=2")), tmp_path
    )


# --- commands in bash blocks --------------------------------------------------------------------------------


def _commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every command line in the bash blocks (comments and continuations handled) and of
    every ``.venv/bin/...`` command quoted inline in the prose."""
    found = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for command in re.findall(r"`(\.venv/bin/[^`]+)`", line):
                found.append((f"{path.relative_to(ROOT)}:{number}", shlex.split(command)))
    for block in (b for b in BLOCKS if b.lang == "bash"):
        for line in block.code.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                found.append((block.where, argv))
    return found


def _splitgrad_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``-m splitgrad`` (or the ``splitgrad`` script); None for other commands."""
    if Path(argv[0]).name == "splitgrad":
        return argv[1:]
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "splitgrad":
            return argv[i + 2 :]
    return None


def _benchmark_source(script: Path) -> str:
    """A benchmark script's text together with the sibling benchmark modules it imports from (a script may
    take shared options from another, e.g. ``from bench_moe_overlap import add_pair_arguments``)."""
    source = script.read_text()
    siblings = re.findall(r"^from (\w+) import", source, flags=re.M)
    return "\n".join(
        [source]
        + [
            (script.parent / f"{name}.py").read_text()
            for name in siblings
            if (script.parent / f"{name}.py").exists()
        ]
    )


def check_command(where: str, argv: list[str], workdir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Check one documented command; returns what was checked. Raises AssertionError naming the command."""
    from splitgrad.__main__ import main
    from splitgrad.cli import demo, split_demo

    shown = f"{where}: {shlex.join(argv)}"
    while len(argv) > 1 and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        argv = argv[1:]  # environment settings for the command (e.g. the allocator's): check the command
    args = _splitgrad_args(argv)
    if args is not None:
        assert Path(argv[0]).name in {"python", "splitgrad", "torchrun"}, shown
        assert argv[0].startswith(".venv/bin/"), f"{shown}: works as written only as .venv/bin/..."
        if args and args[0] == "schedule":
            monkeypatch.chdir(workdir)
            assert main(args) == 0, shown
            return "ran"
        parsed = []
        # demo and split train models: parse their arguments (and build the demo's config) without running.
        monkeypatch.setattr(demo, "run", lambda ns: parsed.append(demo.config_from_args(ns)) or 0)
        monkeypatch.setattr(split_demo, "run", lambda ns: parsed.append(ns) or 0)
        try:
            assert main(args) == 0, shown
        except SystemExit as exc:
            if exc.code == 0 and "--help" in args:
                return "help"
            raise AssertionError(f"{shown}: does not parse (exit {exc.code})") from exc
        assert len(parsed) == 1, shown
        return "parsed"
    if argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(argv[1:]) <= targets, f"{shown}: Makefile targets are {sorted(targets)}"
        return "make target"
    if len(argv) > 1 and argv[1].startswith("benchmarks/"):
        assert argv[0] == ".venv/bin/python", f"{shown}: works as written only as .venv/bin/python"
        source = _benchmark_source(ROOT / argv[1])
        own = argv[2:]
        if argv[1] == "benchmarks/_netns.py" and "--" in own:
            # The namespace wrapper: its own flags, then the command it runs inside, checked the same way.
            own, inner = own[: own.index("--")], own[own.index("--") + 1 :]
            check_command(where, inner, workdir, monkeypatch)
        flags = [a.split("=")[0] for a in own if a.startswith("--")]
        assert all(f'"{flag}"' in source for flag in flags), f"{shown}: unknown flag for {argv[1]}"
        return "benchmark flags"
    if argv[:4] == ["python3", "-m", "venv", ".venv"]:
        return "venv"
    if argv[:3] == [".venv/bin/python", "-m", "pip"] or Path(argv[0]).name == "pip":
        section = (
            (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        )
        extras = set(
            re.findall(r"^([\w-]+)\s*=", section, flags=re.M)
        )  # no tomllib: Python 3.10 is supported
        for spec in (a for a in argv[argv.index("install") + 1 :] if not a.startswith("-")):
            asked = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
            assert asked is not None, f"{shown}: install the checkout as '.' or '.[extra]'"
            assert set(filter(None, (asked.group(1) or "").split(","))) <= extras, f"{shown}: extras {extras}"
        return "pip"
    raise AssertionError(f"{shown}: no check known for this command")


def test_bash_block_commands_work_as_written(tmp_path, monkeypatch):
    checked = [check_command(where, argv, tmp_path, monkeypatch) for where, argv in _commands()]
    assert {"ran", "parsed", "help", "make target", "benchmark flags", "pip"} <= set(checked)


def test_the_command_check_rejects_bad_commands(tmp_path, monkeypatch):
    bad = [
        ["python", "-m", "splitgrad", "schedule", "zb-h1", "--stages", "4"],  # needs the venv active
        [".venv/bin/python", "-m", "splitgrad", "demo", "--no-such-flag"],
        [".venv/bin/python", "-m", "splitgrad", "demo", "--batch-size", "6", "--microbatches", "4"],
        ["make", "no-such-target"],
        [".venv/bin/python", "benchmarks/bench_linear.py", "--no-such-flag"],
        [
            ".venv/bin/python",
            "benchmarks/diag_moe_overlap.py",
            "--no-such-flag",
        ],  # options shared from a sibling
        [
            ".venv/bin/python",
            "benchmarks/_netns.py",
            "--rate",
            "1gbit",
            "--",
            ".venv/bin/python",
            "benchmarks/bench_ddp.py",
            "--no-such-flag",
        ],
        [
            ".venv/bin/python",
            "benchmarks/_netns.py",
            "--no-such-flag",
            "--",
            ".venv/bin/python",
            "benchmarks/bench_ddp.py",
        ],
        ["pip", "install", ".[no-such-extra]"],
        ["curl", "https://example.com"],
        ["MALLOC_TRIM_THRESHOLD_=1", ".venv/bin/python", "benchmarks/bench_grouped.py", "--no-such-flag"],
    ]
    for argv in bad:
        with pytest.raises((AssertionError, ValueError)):
            check_command("sample.md:1", argv, tmp_path, monkeypatch)
    # A flag a script takes from a sibling benchmark module it imports is known.
    shared = [".venv/bin/python", "benchmarks/diag_moe_overlap.py", "--balanced-routing"]
    assert check_command("sample.md:1", shared, tmp_path, monkeypatch) == "benchmark flags"
