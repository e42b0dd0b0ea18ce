"""The shipped gin configs: in the package data, found by name from any folder, includes resolved."""

import fnmatch
import os
import pathlib
import subprocess
import sys

import pytest

from ddiloco.launch import configs

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_checkout_links_gin_configs_to_the_package_folder():
  assert (REPO / "gin_configs").resolve() == pathlib.Path(configs.CONFIG_DIR).resolve()
  assert "local_tiny.gin" in configs.names() and "models/tiny.gin" in configs.names()


def test_every_config_is_package_data():
  """setup.py's package_data globs cover every shipped config (a wheel carries them all)."""
  text = (REPO / "setup.py").read_text()
  patterns = [p for p in ("configs/*.gin", "configs/*/*.gin") if f'"{p}"' in text]
  assert patterns
  missed = [
    n for n in configs.names() if not any(fnmatch.fnmatch(f"configs/{n}", p) for p in patterns)
  ]
  assert not missed


def test_resolve_prefers_a_local_file_then_the_shipped_one(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  shipped = os.path.join(configs.CONFIG_DIR, "local_tiny.gin")
  assert configs.resolve("local_tiny.gin") == shipped
  assert configs.resolve("gin_configs/local_tiny.gin") == shipped
  assert configs.resolve("models/tiny.gin") == os.path.join(configs.CONFIG_DIR, "models/tiny.gin")
  (tmp_path / "local_tiny.gin").write_text("# mine\n")
  assert configs.resolve("local_tiny.gin") == str(tmp_path / "local_tiny.gin")
  assert configs.resolve("nowhere.gin") == "nowhere.gin"  # gin's error then names it.


_PARSE = """
import sys
from ddiloco.launch import gin_flags
gin_flags.flags_parser(["prog", "--gin_file=" + sys.argv[1], "--gin.STEPS=7"])
text = gin_flags.parse_gin(workdir="out")
import gin
from ddiloco.launch.job import JobConfig
print("FORWARDED", gin_flags.forwarded_args()[0])
print("SIZE", gin.query_parameter("transformer_config.size"))
print("STEPS", gin.query_parameter("%STEPS"))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["local_tiny.gin", "gin_configs/chaos/smoke.gin"])
@pytest.mark.integration
def test_gin_file_by_name_from_another_folder(tmp_path, name):
  """`--gin_file=local_tiny.gin` from a folder without configs: the file and its includes parse."""
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", _PARSE, name],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=100,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
  forwarded = lines["FORWARDED"].removeprefix("--gin_file=")
  assert os.path.isabs(forwarded) and os.path.isfile(forwarded)  # Child processes find it too.
  assert forwarded.startswith(configs.CONFIG_DIR)
  assert lines["SIZE"] == "tiny"  # From models/tiny.gin, included by local_tiny.gin.
  assert lines["STEPS"].strip() == "7"
  assert (tmp_path / "out" / "config.gin").is_file()
