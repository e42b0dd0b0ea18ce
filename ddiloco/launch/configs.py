"""The gin configs shipped with the package, found from any folder.

The configs live in `ddiloco/configs/` and install with the package; a checkout also shows them as
`gin_configs/` (a link to that folder), the path the README's commands use. A `--gin_file` is
looked up as given first (relative to the working folder), then in the shipped configs, so
`--gin_file=local_tiny.gin` and `--gin_file=gin_configs/local_tiny.gin` both work anywhere.
Includes inside a config (`include "models/tiny.gin"`) are relative to the configs folder.
"""

import os

import gin

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_REPO_PREFIX = "gin_configs" + os.sep  # The checkout's name for CONFIG_DIR.


def resolve(path: str) -> str:
  """An absolute path to the config `path`: as given if it exists, else a shipped config.

  Returns `path` unchanged when neither exists, so that gin's own error names it.
  """
  if os.path.isfile(path):
    return os.path.abspath(path)
  name = os.path.normpath(path)
  if name.startswith(_REPO_PREFIX):
    name = name[len(_REPO_PREFIX) :]
  shipped = os.path.join(CONFIG_DIR, name)
  if not os.path.isabs(name) and os.path.isfile(shipped):
    return shipped
  return path


def add_search_path() -> None:
  """Lets gin find shipped configs and their includes by their names under the configs folder."""
  gin.add_config_file_search_path(CONFIG_DIR)


def names() -> list[str]:
  """Every shipped config, relative to the configs folder (e.g. "runs/sim_small.gin"), sorted."""
  out = []
  for folder, _, files in os.walk(CONFIG_DIR):
    out += [
      os.path.relpath(os.path.join(folder, f), CONFIG_DIR) for f in files if f.endswith(".gin")
    ]
  return sorted(out)
