"""absl + gin plumbing shared by every entry point (t5x `gin_utils` style).

`--gin_file` is repeatable; `--gin.KEY=VALUE` is rewritten to `--gin_bindings=KEY=VALUE` before absl
parses the command line, so users can write overrides the way t5x users do. `parse_gin` registers
every configurable (launch/configurables.py) before it parses; the entry point then builds its
top-level object with `configurables.configured(...)`.
"""

import difflib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import gin
from absl import flags

from ddiloco.launch import configs

_GIN_FILE = flags.DEFINE_multi_string("gin_file", [], "gin config file(s); repeatable.")
_GIN_BINDINGS = flags.DEFINE_multi_string(
  "gin_bindings", [], "gin bindings KEY=VALUE; `--gin.KEY=VALUE` is the short form."
)
_GIN_SEARCH_PATHS = flags.DEFINE_multi_string(
  "gin_search_paths", ["."], "folders in which relative --gin_file paths and includes are searched."
)


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
  """Turns `--gin.KEY=VALUE` into `--gin_bindings=KEY=VALUE` (and `--gin.KEY VALUE`)."""
  out: list[str] = []
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--gin."):
      body = arg[len("--gin.") :]
      if "=" in body:
        key, value = body.split("=", 1)
      elif i + 1 < len(argv):
        key, value = body, argv[i + 1]
        i += 1
      else:
        raise ValueError(f"{arg} needs a value: --gin.KEY=VALUE")
      out.append(f"--gin_bindings={key} = {value}")
    else:
      out.append(arg)
    i += 1
  return out


def flags_parser(argv: Sequence[str]) -> list[str]:
  """An absl `flags_parser` for `app.run` that understands `--gin.KEY=VALUE`."""
  return flags.FLAGS(rewrite_gin_args(list(argv)))


def add_bindings(bindings: Sequence[str]) -> None:
  """Appends bindings after the command line's (a launcher's own flags, as `--gin.KEY=VALUE`).

  They are parsed, checked and forwarded to child processes like the user's, so a flag such as
  ddiloco-ray's `--address` goes through the same validation as `RayConfig.address` in a file.
  """
  flags.FLAGS.gin_bindings = [*_GIN_BINDINGS.value, *bindings]


def forwarded_args() -> list[str]:
  """This command line's gin flags, with absolute paths, to forward verbatim to child processes."""
  out = [f"--gin_file={configs.resolve(f)}" for f in _GIN_FILE.value]
  out += [f"--gin_bindings={b}" for b in _GIN_BINDINGS.value]
  out += [f"--gin_search_paths={os.path.abspath(p)}" for p in _GIN_SEARCH_PATHS.value]
  return out


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
  """ "Did you mean 'a' or 'b'?" with the closest candidates to a misspelled name, or ""."""
  close = difflib.get_close_matches(name, sorted(candidates), n=2)
  return f"Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def references() -> Iterator[gin.config.ConfigurableReference]:
  """Every reference (`@X()`, `%MACRO`) in the parsed configuration's values, nested ones too."""

  def walk(value: Any) -> Iterator[gin.config.ConfigurableReference]:
    if isinstance(value, gin.config.ConfigurableReference):
      yield value
    elif isinstance(value, list | tuple | set):
      for v in value:
        yield from walk(v)
    elif isinstance(value, dict):
      for v in value.values():
        yield from walk(v)

  for params in gin.config._CONFIG.values():  # gin has no public listing of its bindings.
    for value in params.values():
      yield from walk(value)


def _check_macros(bindings: Sequence[str]) -> None:
  """Refuses a macro set by a binding (`--gin.NAME=VALUE`) that no binding uses (`%NAME`).

  gin takes `--gin.LEARNRS=8` as a new macro and ignores it: the run would silently use the file's
  value. Such a name is almost always a misspelling.

  Raises:
    ValueError: naming the macro and the closest macros the configuration uses.
  """
  used = {
    ref.scoped_selector.split("/")[-2]
    for ref in references()
    if ref.scoped_selector.endswith("/gin.macro")
  }
  for binding in bindings:
    name = binding.split("=", 1)[0].strip()
    if not name or "." in name or "/" in name or name in used:
      continue
    hint = did_you_mean(name, used)
    raise ValueError(
      f"Macro {name!r} is set by a binding but used nowhere in the configuration."
      f"{' ' + hint if hint else ''} (in --gin.{binding.strip()})"
    )


def parse_gin(workdir: str | None = None) -> str:
  """Parses --gin_file/--gin_bindings, writes the operative config to `workdir`, returns its text.

  Raises:
    ValueError: if no gin file was given.
  """
  if not _GIN_FILE.value:
    raise ValueError("At least one --gin_file is required.")
  # Every process of a run parses the same files (a chaos run's file binds ChaosConfig, which only
  # the driver uses), so every entry point registers every configurable. Imported here, after the
  # entry point has set XLA_FLAGS and JAX_PLATFORMS: registering imports jax.
  from ddiloco.launch import configurables

  # A name like "local_tiny.gin" is a shipped config when no such file is here (launch/configs.py);
  # includes are searched in --gin_search_paths, next to each file and among the shipped configs.
  configurables.parse(_GIN_FILE.value, _GIN_BINDINGS.value, search_paths=_GIN_SEARCH_PATHS.value)
  _check_macros(_GIN_BINDINGS.value)
  text = gin.config_str()
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.gin"), "w") as f:
      f.write(text)
  return text
