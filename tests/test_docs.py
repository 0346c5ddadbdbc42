"""The documentation (README.md, docs/*.md, ci/README.md) says what the code does, once.

- Every public name, ``nanfuzz.__all__``, is defined in docs/ by exactly one heading that
  starts with it in a code span: ``### `nanfuzz.NAME` `` or ``### `nanfuzz.NAME(args)` ``.
- Every relative link resolves to a file, and its ``#anchor`` to a heading of that file.
- Every ``nanfuzz`` command in a shell block parses with the command line's own parser.
- The Python blocks run. A block whose first line is ``# PATH.py`` is that file of a scratch
  copy of tests/example_repo/ (the repository the examples are written for): a page's files
  are written there, its modules imported and its ``tests/test_*.py`` files run by pytest.
  A block's info string may add a tag after ``python``: ``python gpu`` runs only on a GPU,
  ``python network`` not with ``NANFUZZ_OFFLINE=1``; any other tag is refused.
- The README stays a front door: under 250 lines, the quick start the two commands CI runs,
  and one link away from every page.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

import nanfuzz

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "ci" / "README.md"]
EXAMPLE_REPO = ROOT / "tests" / "example_repo"
QUICK_START = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && nanfuzz fuzz",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test]' && python -m pytest -n 2",
]
SHELLS = ("bash", "sh", "shell", "console")
PYTHON_TAGS = ("gpu", "network")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # of the opening fence, counting from 1
    language: str
    tags: tuple[str, ...]
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def path(self) -> str | None:
        """The file a Python block is (its first line ``# PATH.py``), or None for a script."""
        first = self.code.split("\n", 1)[0]
        match = re.fullmatch(r"# ([\w./-]+\.py)", first.strip())
        return match.group(1) if match else None


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown page."""
    lines = (page.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})\s*(\S*)\s*(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        fence, start = opening.group(1), i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        found.append(Block(page, start + 1, opening.group(2), tuple(opening.group(3).split()),
                           "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return found


def prose(text: str) -> str:
    """The page without its fenced and inline code, where a bracket is not a link."""
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", prose_keeping_code_spans(text), re.MULTILINE)]


def prose_keeping_code_spans(text: str) -> str:
    return re.sub(r"^(`{3,}).*?^\1\s*$", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in headings(text):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


# -- public names ----------------------------------------------------------------------

DEFINITION = re.compile(r"^#{2,4} `nanfuzz\.(\w+)", re.MULTILINE)


def definition_problems(texts: list[str], public: list[str]) -> list[str]:
    """What breaks "each public name defined once": names defined never or twice, and
    definitions of names that are not public."""
    defined = Counter(name for text in texts for name in DEFINITION.findall(prose_keeping_code_spans(text)))
    problems = [f"{name} is defined {defined[name]} times" for name in public if defined[name] != 1]
    problems += [f"{name} is defined but not in nanfuzz.__all__" for name in defined if name not in public]
    return problems


def test_every_public_name_is_defined_once_in_docs():
    assert definition_problems([page.read_text() for page in DOCS], list(nanfuzz.__all__)) == []


def test_the_definition_check_sees_a_missing_a_doubled_and_a_stale_name():
    texts = ["### `nanfuzz.fuzz(kernel)`\n\n#### `nanfuzz.Kernel`\n", "## `nanfuzz.fuzz`\n### `nanfuzz.Gone`\n"
             "```python\n# `nanfuzz.check` in a block defines nothing\n```\n"]
    assert definition_problems(texts, ["fuzz", "Kernel", "check"]) == [
        "fuzz is defined 2 times", "check is defined 0 times", "Gone is defined but not in nanfuzz.__all__"]


# -- links -----------------------------------------------------------------------------

def broken_links(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    text = ("# Top\n## Two `words`!\nSee [a](page.md#two-words), [b](#top), [c](gone.md), [d](#nowhere),\n"
            "[e](https://example.org/x) and `[not](a-link.md)`.\n")
    page.write_text(text)
    assert broken_links(page) == ["gone.md: no such file", "#nowhere: no heading #nowhere in page.md"]


# -- shell blocks ----------------------------------------------------------------------

def nanfuzz_commands(code: str) -> list[list[str]]:
    """The argument lists of every ``nanfuzz`` (or ``python -m nanfuzz``) command in shell code."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        current = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", "|", ";", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
    found = []
    for words in commands:
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value before a command
            words = words[1:]
        if words[:1] == ["nanfuzz"]:
            found.append(words[1:])
        elif words[:3] in (["python", "-m", "nanfuzz"], ["python3", "-m", "nanfuzz"]):
            found.append(words[3:])
    return found


def usage_error(args: list[str]) -> str | None:
    """Why the command line refuses ``args`` (None when it parses them)."""
    from nanfuzz.harness import cli
    from nanfuzz.harness.gate import merge, run

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            if args[:2] == ["gate", "merge"]:
                merge.parse_args(args[2:])
            elif args[:1] == ["gate"]:
                run.parse_args(args[1:])
            else:
                cli._parser().parse_args(args)
    except SystemExit as exc:
        return None if exc.code == 0 else stderr.getvalue().strip() or f"exit {exc.code}"
    except nanfuzz.NanfuzzError as exc:
        return str(exc)
    return None


def _shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language in SHELLS]


def test_the_docs_show_nanfuzz_commands():
    assert sum(len(nanfuzz_commands(b.code)) for b in _shell_blocks()) >= 30


@pytest.mark.parametrize("block", _shell_blocks(), ids=lambda b: b.where)
def test_shell_blocks_name_only_real_subcommands_and_options(block):
    refused = {" ".join(args): usage_error(args) for args in nanfuzz_commands(block.code)}
    assert {command: why for command, why in refused.items() if why} == {}


def test_the_shell_check_sees_a_wrong_subcommand_or_option():
    code = ("nanfuzz frobnicate\nA=1 nanfuzz fuzz --kernel k --no-such-flag  # comment\n"
            "cd x && python -m nanfuzz replay r.json --kernel k\nnanfuzz gate --grace 0\n"
            "nanfuzz gate merge\nnanfuzz fuzz \\\n    --seed 3\n")
    commands = nanfuzz_commands(code)
    assert commands == [["frobnicate"], ["fuzz", "--kernel", "k", "--no-such-flag"], ["replay", "r.json", "--kernel", "k"],
                        ["gate", "--grace", "0"], ["gate", "merge"], ["fuzz", "--seed", "3"]]
    assert [usage_error(args) is None for args in commands] == [False, False, True, False, False, True]


# -- python blocks ---------------------------------------------------------------------

def _python_pages() -> list[Path]:
    return [page for page in PAGES if any(b.language == "python" for b in blocks(page))]


def test_python_block_tags_are_known():
    unknown = [f"{b.where}: {b.tags}" for page in PAGES for b in blocks(page)
               if b.language == "python" and not set(b.tags) <= set(PYTHON_TAGS)]
    assert unknown == []


def _runnable(block: Block) -> bool:
    if "gpu" in block.tags:
        from nanfuzz.harness.launch.backend import gpu_available

        if not gpu_available():
            return False
    return not ("network" in block.tags and os.environ.get("NANFUZZ_OFFLINE") == "1")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_", "PYTHONPATH"))}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    proc.log = f"$ {' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("page", _python_pages(), ids=[str(p.relative_to(ROOT)) for p in _python_pages()])
def test_python_blocks_run(page, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".nanfuzz"))
    python = [b for b in blocks(page) if b.language == "python" and _runnable(b)]
    if not python:
        pytest.skip(f"every Python block of {page.name} needs a GPU or the network")
    modules, tests, scripts = [], [], []
    for block in python:
        if block.path is None:
            scripts.append(block.code)
            continue
        target = (repo / block.path).resolve()
        assert target.is_relative_to(repo), f"{block.where}: {block.path} leaves the repository"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        if block.path.startswith("tests/") and Path(block.path).name.startswith("test_"):
            tests.append(block.path)
        else:
            modules.append(block.path[:-3].replace("/", "."))
    # one pytest session: the modules import and the scripts run (each in a namespace of its own), then the tests
    (repo / "tests").mkdir(exist_ok=True)
    (repo / "tests" / "test_docs_blocks.py").write_text(
        "import importlib\n\n\n"
        f"def test_the_modules_import():\n    for name in {modules!r}:\n        importlib.import_module(name)\n\n\n"
        f"def test_the_scripts_run():\n    for code in {scripts!r}:\n"
        "        exec(compile(code, 'block', 'exec'), {'__name__': '__main__'})\n")
    # a few examples of a seeded search: enough to meet a dead-slot bug the examples show
    tested = _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", "--nanfuzz-examples", "3",
                   "--hypothesis-seed", "0", "tests/test_docs_blocks.py", *tests], repo)
    assert tested.returncode == 0, tested.log
    passed = re.search(r"(\d+) passed", tested.stdout)
    assert passed and int(passed.group(1)) >= len(tests) + 2 and "skipped" not in tested.stdout, tested.log


def test_the_block_reader_sees_files_scripts_and_tags(tmp_path):
    page = tmp_path / "page.md"
    text = "x\n```python gpu\n# pkg/mod.py\nA = 1\n```\n````bash\nnanfuzz list\n````\n```python\nprint(1)\n```\n"
    found = blocks(page, text)
    assert [(b.line, b.language, b.tags, b.path) for b in found] == [
        (2, "python", ("gpu",), "pkg/mod.py"), (6, "bash", (), None), (9, "python", (), None)]
    assert found[0].code == "# pkg/mod.py\nA = 1\n"


# -- the front door --------------------------------------------------------------------

def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    first = next(b for b in blocks(README) if b.language in SHELLS)
    assert first.code.splitlines() == QUICK_START
    linked = {(README.parent / target).resolve() for target in re.findall(r"\]\(([^)#\s]+)", prose(text))}
    assert [page.name for page in DOCS if page not in linked] == []
    assert ROOT / "ci" / "README.md" in linked
