"""Every reference in the docs and the code points at something a user can open in this repository."""

import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SUFFIXES = {".py", ".md", ".gin", ".ipynb", ".proto", ".sh", ".toml", ".txt", ".cfg"}
_SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache"}
# A specification file that is not in the repository, and tracker issue numbers.
_DANGLING = re.compile(r"\bSPEC(\.md)?\b|\b[Ii]ssues?[ -]#?\d+")
_SECTION = re.compile(r"docs/algorithm\.md §(\d+(?:\.\d+)?)")
# These tests' own examples of what they refuse.
_HERE = pathlib.Path(__file__).resolve()
_EXAMPLES = {_HERE, _HERE.with_name("process_words_test.py")}


def _files():
  for path in sorted(_ROOT.rglob("*")):
    rel = path.relative_to(_ROOT)
    if rel.parts[0] in _SKIP_DIRS or any(p.endswith(".egg-info") for p in rel.parts):
      continue
    if path.is_file() and path.suffix in _SUFFIXES and path.resolve() not in _EXAMPLES:
      yield rel, path.read_text(errors="replace")


def test_no_references_to_files_or_issues_outside_the_repository():
  found = [
    f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
    for rel, text in _files()
    for m in _DANGLING.finditer(text)
  ]
  assert not found, "References a user cannot open:\n" + "\n".join(found)


def test_cited_algorithm_sections_exist():
  headings = (_ROOT / "docs/algorithm.md").read_text()
  sections = set(re.findall(r"^## §(\d+) ", headings, flags=re.M))
  assert {"1", "2", "3", "4", "5", "6", "7"} <= sections
  cited = {(str(rel), m.group(1)) for rel, text in _files() for m in _SECTION.finditer(text)}
  assert cited, "the code cites docs/algorithm.md sections; the pattern must find them"
  missing = sorted((rel, s) for rel, s in cited if s.split(".")[0] not in sections)
  assert not missing, f"docs/algorithm.md has no such section: {missing}"
