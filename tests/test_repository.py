"""The repository describes the library as it is now: checks that keep it so.

History (what was tried, when, how it measured) lives in git and in issue notes, never in
tracked files; these tests fail on the usual ways it creeps back in.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A word for a round of work followed by its number.
NARRATION = re.compile(r"(^|[^a-z])(session|run)s? [0-9]+", re.IGNORECASE)
NOTES_POINTER = re.compile("NOTES" + r"\.md")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".ini", ".txt", ".json", ".cfg", ".yml", ".yaml")
MAX_README_LINES = 250
MAX_MODULE_LINES = 900


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        files = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def _text_files() -> list[str]:
    names = [f for f in _tracked_files() if f.endswith(TEXT_SUFFIXES) or "/" not in f
             or f.startswith(".ci/")]
    assert names, "found no tracked text files"
    return names


def test_no_file_narrates_rounds_of_work():
    hits = []
    for name in _text_files():
        with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if NARRATION.search(line) or NOTES_POINTER.search(line):
                    hits.append(f"{name}:{lineno}: {line.strip()[:100]}")
    assert not hits, "history belongs in git, not in tracked files:\n" + "\n".join(hits)


def test_narration_pattern_catches_what_it_should():
    for text in ("sess" "ion 15", "Ru" "ns 41-42", "(ru" "n 7)", "see NOTES" ".md"):
        assert NARRATION.search(text) or NOTES_POINTER.search(text), text
    for text in ("pytest -n 2", "a run of 3 steps", "runtime 5 s", "rerun 2x"):
        assert not NARRATION.search(text), text


def test_readme_is_a_product_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    for doc in ("docs/design.md", "docs/performance.md", "docs/tuning.md"):
        assert os.path.isfile(os.path.join(ROOT, doc)), doc


def test_no_module_has_grown_two_jobs():
    long = []
    for name in _tracked_files():
        if name.startswith("pallas_flash/") and name.endswith(".py"):
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                n = sum(1 for _ in f)
            if n > MAX_MODULE_LINES:
                long.append(f"{name}: {n} lines")
    assert not long, "split these modules:\n" + "\n".join(long)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_ci_runs_both_ends_of_the_jax_range():
    """pyproject's jax range starts at the version the README's test command pins and ends
    above the newest version .ci/run also tests, so every end of the range is one CI ran."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        project = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    for package in ("jax", "jaxlib"):
        low, high = re.search(rf'"{package}>=([0-9.]+),<([0-9.]+)"', project).groups()
        assert f'"{package}=={low}"' in project, f"[test] must pin {package} at {low}"
        newest = re.search(r"^NEWEST_JAX=([0-9.]+)$", ci, re.MULTILINE).group(1)
        assert _version(low) < _version(newest) < _version(high), (low, newest, high)
        assert f'"{package}==$NEWEST_JAX"' in ci
