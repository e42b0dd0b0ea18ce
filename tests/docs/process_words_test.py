"""The project speaks for itself: no words of how it was made in its docs, code or configs.

A reader cannot open the notes, trackers and shared files the project was built with, nor does
"measured in session 17" or "the lead's re-run" tell them which figure is current. History lives
in git. So README.md, docs/, the library (its gin configs included), experiments/ and scripts/ name
no work session, helper, lead, tracker issue or shared planning file, and the results page stays a
page of current figures (docs/results.md, at most `RESULTS_MAX_LINES` lines).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "ddiloco", "experiments", "scripts")
SUFFIXES = {".md", ".ipynb", ".py", ".gin", ".sh", ".proto"}
RESULTS_MAX_LINES = 600

# Each pattern names one kind of process word; a match is reported with the pattern's name.
PATTERNS = {
  # "session 17", "sessions 16 to 19", "this session's fix" (a learner's gRPC session is no hit).
  "a work session": re.compile(
    r"\bsessions? \d+|\b(?:this|last|next|an earlier|a later) session\b", re.I
  ),
  # People who did the work, not helper threads or functions: "another helper's benchmark",
  # "helpers' runs", "helper B", "Helper probes", "measured by the helper".
  "a helper": re.compile(
    r"\bhelpers?'|\bhelper's\b|\bhelper [A-Z]\b|\bhelpers? (?:probes?|runs?|jobs?|work|tests)\b"
    r"|\b(?:another|other|two|three|four|five|several|by the|of the) helpers?\b(?! threads?\b)",
    re.I,
  ),
  "the lead": re.compile(r"\bthe lead\b", re.I),
  # Tracker issues: "issue 35", "#35", "the goal", "later issues".
  "an issue": re.compile(
    r"\bissues? #?\d+|(?<![\w&/#])#\d{1,4}\b|\bissue's\b"
    r"|\b(?:the|this|that|later|next|open|an|another) issues?\b(?! (?:a|an|the|its)\b)",
    re.I,
  ),
  # Shared planning files a user of the project cannot open (docs/architecture.md is fine).
  "a shared file": re.compile(r"\bSPEC\.md\b|\bARCHITECTURE\.md\b"),
}


def _scanned_files():
  for name in SCANNED:
    path = ROOT / name
    paths = [path] if path.is_file() else sorted(path.rglob("*"))
    for p in paths:
      if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts:
        yield p


def find_process_words(text: str) -> list[tuple[int, str, str]]:
  """(line, pattern name, matched text) of every process word in `text`."""
  found = []
  for kind, pattern in PATTERNS.items():
    for m in pattern.finditer(text):
      found.append((text.count("\n", 0, m.start()) + 1, kind, m.group(0)))
  return sorted(found)


@pytest.mark.parametrize(
  "text",
  [
    "measured in session 17",
    "Sessions 16 to 19 re-measured it",
    "before this session's fix",
    "the machine was shared with helpers' runs",
    "another helper's capacity benchmark",
    "measured by the helper",
    "Helper probes of the same code",
    "helper B ran it",
    "the lead's quiet re-measurement",
    "re-measured by the lead",
    "the issue's goal is not met",
    "see issue 35",
    "fixed in #12",
    "what is left for later issues",
    "as SPEC.md says",
    "ARCHITECTURE.md §3",
  ],
)
def test_each_kind_of_process_word_is_found(text):
  assert find_process_words(text), text


@pytest.mark.parametrize(
  "text",
  [
    "Register issues a per-learner session",
    "the syncer issues a new one",
    "a learner's session credential, in its own session",
    "Register voids the previous session",
    "a pull's frames are read ahead in a helper thread",
    "the other helper threads",
    "stops and joins the helper; Parameter helpers shared by the models",
    "helpers for tests of ddiloco; orbax's path helpers",
    "the leader chooses the step",
    "docs/architecture.md, 'The sharded syncer'",
    "colour #1f77b4, a C++ header <x>&#160;",
  ],
)
def test_ordinary_words_are_not_process_words(text):
  assert not find_process_words(text), text


def test_no_process_words_in_the_project():
  files = list(_scanned_files())
  assert any(p.name == "results.md" for p in files) and any(p.suffix == ".gin" for p in files)
  found = [
    f"{p.relative_to(ROOT)}:{line}: {kind}: {match!r}"
    for p in files
    for line, kind, match in find_process_words(p.read_text(errors="replace"))
  ]
  assert not found, "Process words (history belongs in git):\n" + "\n".join(found)


def test_results_page_is_short():
  lines = (ROOT / "docs" / "results.md").read_text().count("\n")
  assert lines <= RESULTS_MAX_LINES, (
    f"docs/results.md has {lines} lines (at most {RESULTS_MAX_LINES})"
  )
