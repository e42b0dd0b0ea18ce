"""What every `ddiloco-*` console script shares: its help, one-line errors and a quiet start.

A console script's wrapper is a `__main__` module without a docstring that calls `sys.exit(run())`,
so absl's own `--help` printed a bare "USAGE" line and exited 1. `run` prints the entry point's module
docstring and its flags (`--helpfull`: every flag) and exits 0.

A bad command line or configuration ends in one line and exit status 2, before anything is written:
an unknown or missing flag, a missing or unparsable gin file, a misspelled binding (with the closest
registered name), a value a config refuses (`__post_init__`), an unwritable workdir. Entry points
check their configuration inside `bad_config()` and only then create their workdir
(`make_workdir`). Errors after that are bugs or failures of the run and keep their traceback.

`quiet_logs` drops the start-up noise of libraries: gin's "Path not found" for every include it
first looks for as a Python package, jax's "Unable to initialize backend 'tpu'" on a host without
one, and orbax's per-save INFO lines. Warnings and errors still show.
"""

import contextlib
import inspect
import logging
import math
import os
import re
import sys
import tokenize
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from absl import app, flags

from ddiloco import storage
from ddiloco.launch import gin_flags

USAGE_ERROR = 2  # The exit status of a bad command line (as argparse).
_HELP = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
_HELPFULL = ("--helpfull", "-helpfull")


def run(
  main: Callable[[list[str]], Any],
  *,
  prog: str,
  module: str,
  gin: bool = True,
  shared_flags: Sequence[str] = (),
) -> None:
  """Runs `main` under absl with this module's help, one-line errors and quiet logs.

  Args:
    main: the entry point's main(argv).
    prog: the console script's name, for messages ("ddiloco-local").
    module: the entry point's `__name__`: its docstring is the help, its flags are listed.
    gin: whether the command takes --gin_file/--gin.KEY=VALUE.
    shared_flags: modules whose flags the command takes too (listed by its --help).
  """
  quiet_logs()
  entry = sys.modules[module]
  # absl registers a module's flags under sys.argv[0] when it runs as __main__ (python -m).
  flag_modules = [sys.argv[0] if module == "__main__" else module, *shared_flags]
  if gin:
    flag_modules.append(gin_flags.__name__)

  def parse(argv: Sequence[str]) -> list[str]:
    args = list(argv)
    head = args[: args.index("--")] if "--" in args else args
    if any(a in _HELPFULL for a in head):
      _print_help(entry.__doc__, flags.FLAGS.get_help())
    if any(a in _HELP for a in head):
      helps = [flags.FLAGS.module_help(m) for m in flag_modules]
      _print_help(entry.__doc__, "\n\n".join(h for h in helps if h), short=True)
    try:
      rest = gin_flags.flags_parser(args) if gin else flags.FLAGS(args)
    except (flags.Error, ValueError) as e:
      fail(prog, f"{_one_line(str(e))} (see {prog} --help)")
    _refuse_nan_flags(prog)
    return rest

  def checked_main(argv: list[str]) -> Any:
    try:
      return main(argv)
    except app.UsageError as e:
      fail(prog, str(e))

  app.run(checked_main, flags_parser=parse)


def _refuse_nan_flags(prog: str) -> None:
  """Fails on a float flag given as NaN: absl's bounds compare with `<`, which NaN passes, and a
  NaN timeout or loss would only be found once the run was under way (or never)."""
  for name in flags.FLAGS:
    flag = flags.FLAGS[name]
    if flag.present and isinstance(flag.value, float) and math.isnan(flag.value):
      fail(prog, f"--{flag.name}={flag.value}: not a number (see {prog} --help)")


def _print_help(doc: str | None, flag_help: str, *, short: bool = False) -> NoReturn:
  out = [(doc or "").strip(), "", "flags:", flag_help]
  if short:
    out += ["", "--helpfull lists every flag, the libraries' too."]
  try:
    print("\n".join(out), flush=True)
  except BrokenPipeError:  # `ddiloco-local --help | head`: the reader left; exit quietly.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # As the Python docs advise.
  sys.exit(0)


def fail(prog: str, message: str) -> NoReturn:
  """Prints `prog: error: message` (one line) to stderr and exits with status 2."""
  print(f"{prog}: error: {_one_line(message)}", file=sys.stderr, flush=True)
  sys.exit(USAGE_ERROR)


def _one_line(text: str) -> str:
  return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


# -- configuration errors ---------------------------------------------------------------------


@contextlib.contextmanager
def bad_config() -> Iterator[None]:
  """Turns the errors of parsing and checking a configuration into one-line `app.UsageError`s.

  Wrap the parsing of gin files and the building of config objects, nothing that runs: a ValueError
  from inside a run is a bug and keeps its traceback.
  """
  try:
    yield
  except (ValueError, TypeError, SyntaxError, OSError, tokenize.TokenError) as e:
    raise app.UsageError(describe_config_error(e)) from e


def describe_config_error(error: BaseException) -> str:
  """One line for a gin or config error: the problem, a suggestion, and where it was bound."""
  text = str(error)
  if isinstance(error, tokenize.TokenError):  # gin's tokenizer: unbalanced brackets or quotes.
    return f"cannot parse a gin file or binding: {error.args[0]}"
  if isinstance(error, SyntaxError) and error.msg:  # gin's parser: file, line and offending text.
    where = f"{error.filename or 'a binding'} line {error.lineno}"
    return f"cannot parse {where}: {error.msg}: {(error.text or '').strip()}"
  lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
  if not lines:
    return type(error).__name__
  message, where = lines[0], ""
  # gin appends where a binding came from ("In file "x.gin" line 3", the binding itself) or which
  # configurable refused its arguments ("In call to configurable 'JobConfig' (<class ...>)").
  for i, line in enumerate(lines[1:], start=1):
    if line.startswith("In call to configurable"):
      name = re.search(r"'([^']+)'", line)
      where = where or (f"in {name.group(1)}" if name else "")
    elif line.startswith("In bindings string"):
      where = f"in --gin.{lines[i + 1]}" if i + 1 < len(lines) else "in a --gin binding"
    elif line.startswith("In file"):
      binding = f": {lines[i + 1]}" if i + 1 < len(lines) else ""
      where = f"in {line[len('In ') :]}{binding}"
  hint = _suggestion(message)
  return " ".join(part for part in (message, hint, f"({where})" if where else "") if part)


# Parameters that moved, with where they live now (a config written for an older version).
_MOVED = {
  ("SyncerConfig", "overlap"): "τ is set once, for learners and syncer alike: bind "
  "FragmentSchedule.overlap instead.",
  ("SyncerConfig", "merge_method"): "The merge rule is an object now: bind "
  'SyncerConfig.merge_rule = @RDA() (was "rda") or @WeightedMean() (was "mean").',
  ("ServiceConfig", "bulk"): "Pushes and pulls always travel over the syncer's bulk port now: "
  "drop the binding, and let learners reach ServiceConfig.bulk_port as the gRPC port.",
  ("simulate", "cluster"): "The virtual fleet is simulate.fleet now, and the run's size, length "
  "and cadence are RunConfig's (num_learners, steps_per_learner, batch_size, eval_every_s, "
  "log_every).",
}
# What a run is moved to `RunConfig`, which the simulator and the distributed launchers share.
_RUN_FIELDS = {
  "JobConfig": (
    "model data task schedule syncer learner inner_opt service num_learners steps_per_learner "
    "batch_size layout_strategy split_large seed eval_batches eval_batch_size eval_every_s log_every"
  ),
  "simulate": (
    "model data task schedule syncer learner inner_opt service layout_strategy split_large seed "
    "eval_batches eval_batch_size"
  ),
  "ClusterConfig": "num_learners steps_per_learner batch_size eval_every_s log_every",
}
_MOVED.update(
  {
    (owner, name): f"What a run is lives in RunConfig: bind RunConfig.{name} instead."
    for owner, names in _RUN_FIELDS.items()
    for name in names.split()
  }
)


def _suggestion(message: str) -> str:
  """A "Did you mean" for gin's unknown configurable or parameter errors, what to bind for a
  required argument no binding gave, or an empty string."""
  m = re.match(r"([\w.]+)\(\) missing \d+ required (?:keyword-only )?arguments?: (.+)", message)
  if m:  # "simulate() missing ...", "GoodputStudy.__init__() missing ...".
    owner = m.group(1).removesuffix(".__init__")
    names = re.findall(r"'(\w+)'", m.group(2))
    return f"Bind {' and '.join(f'{owner}.{n}' for n in names)} in a gin file."
  m = re.match(r"No configurable matching (?:reference )?'@?([^'()]+)", message)
  if m:
    names = {sel.split(".")[-1] for sel, _ in _registry().items()}
    return gin_flags.did_you_mean(m.group(1).split(".")[-1], sorted(names))
  m = re.match(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", message)
  if m and (m.group(1).split(".")[-1], m.group(2)) in _MOVED:
    return _MOVED[(m.group(1).split(".")[-1], m.group(2))]
  if m:
    configurable = _registry().get_match(m.group(1))
    if configurable is None:
      return ""
    try:
      params = list(inspect.signature(configurable.wrapped).parameters)
    except (TypeError, ValueError):
      return ""
    hint = gin_flags.did_you_mean(m.group(2), params)
    return hint or f"{m.group(1)} takes: {', '.join(p for p in params if p != 'self')}."
  return ""


def _registry() -> Any:
  import gin

  # gin has no public listing of its configurables; its registry is a SelectorMap of them.
  return gin.config._REGISTRY


def make_workdir(
  workdir: str,
  config_text: str | None = None,
  *,
  remote_ok: bool = False,
  why_local: str = "this command reads and writes it as a file system",
) -> str:
  """Creates `workdir` (returned absolute, or as given for an object store URI such as gs://... where
  `remote_ok`; ddiloco/storage.py) and writes the operative gin config into it.

  Raises:
    app.UsageError: for a URI where not `remote_ok` (saying `why_local`), or if it cannot be
      created or written (nothing is left behind).
  """
  if not remote_ok:
    try:
      storage.require_local(workdir, who="--workdir", why=why_local)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  workdir = storage.resolve(workdir)
  existed = storage.is_remote(workdir) or os.path.isdir(workdir)
  try:
    storage.makedirs(workdir)
    if config_text is not None:
      storage.write_text(storage.join(workdir, "config.gin"), config_text)
  except (OSError, ImportError, NotImplementedError) as e:
    if not existed and os.path.isdir(workdir) and not os.listdir(workdir):
      os.rmdir(workdir)
    reason = getattr(e, "strerror", None) or e
    if isinstance(e, ImportError) and workdir.startswith("gs://"):
      reason = "gs:// needs gcsfs: pip install 'ddiloco[gcs]'"
    raise app.UsageError(f"cannot write the workdir {workdir}: {reason}") from e
  return workdir


# -- logs -------------------------------------------------------------------------------------


class _StartupNoise(logging.Filter):
  """Drops the library log records listed in the module docstring."""

  def filter(self, record: logging.LogRecord) -> bool:
    path = record.pathname.replace(os.sep, "/")
    if path.endswith("gin/resource_reader.py") and record.levelno <= logging.ERROR:
      return False  # gin falls back to the search paths after these; a missing file still fails.
    if record.name.startswith("jax") and str(record.msg).startswith("Unable to initialize backend"):
      return record.levelno > logging.INFO  # INFO: a platform this host lacks (jax moves on).
    return not ("/orbax/" in path and record.levelno < logging.WARNING)


_FILTER = _StartupNoise()


def quiet_logs() -> None:
  """Installs the filter on the loggers that gin (root), orbax (absl) and jax log through."""
  for name in ("", "absl", "jax._src.xla_bridge"):
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
      logger.addFilter(_FILTER)
