"""Tests of the study helpers: t intervals, tables, the result store, one real (tiny) run."""

import math
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)  # The study helpers live with the experiments, out of the library.

from experiments.studylib import study  # noqa: E402

GIN_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "gin_configs"))


def test_mean_ci_three_values_by_hand():
  # [1, 2, 3]: mean 2, s = 1 (ddof 1); t_{0.975, 2} = 4.302653; half-width 4.302653 / √3 = 2.484138.
  ci = study.mean_ci([1.0, 2.0, 3.0])
  assert ci.n == 3
  assert ci.mean == pytest.approx(2.0)
  assert ci.half_width == pytest.approx(2.484138, abs=1e-6)


def test_mean_ci_two_values_and_other_confidence():
  # [2, 4]: mean 3, s = √2; t_{0.975, 1} = 12.706205; half-width 12.706205 · √2 / √2 = 12.706205.
  assert study.mean_ci([2.0, 4.0]).half_width == pytest.approx(12.706205, abs=1e-6)
  # 90 %: t_{0.95, 1} = 6.313752.
  assert study.mean_ci([2.0, 4.0], 0.90).half_width == pytest.approx(6.313752, abs=1e-6)


def test_mean_ci_degenerate_inputs():
  one = study.mean_ci([5.0])
  assert (one.mean, one.n) == (5.0, 1) and math.isnan(one.half_width)
  assert study.mean_ci([]).n == 0
  assert study.mean_ci([7.0, 7.0, 7.0]).half_width == 0.0
  with pytest.raises(ValueError, match="Non-finite"):
    study.mean_ci([1.0, math.nan])
  with pytest.raises(ValueError, match="confidence"):
    study.mean_ci([1.0, 2.0], confidence=1.0)


def test_interval_format():
  assert study.Interval(2.0, 2.484138, 3).format(2) == "2.00 ± 2.48"
  assert study.Interval(0.0123, 0.004, 3).format(2, scale=100, unit=" %") == "1.23 % ± 0.40 %"
  assert study.Interval(2.5, math.nan, 1).format(3) == "2.500 (1 seed)"
  assert study.Interval(math.nan, math.nan, 0).format() == "–"


def test_paired_relative_ci_uses_common_seeds_only():
  # Seeds 0 and 1 are in both: 1.1 / 1.0 − 1 = 0.1 and 2.2 / 2.0 − 1 = 0.1; seed 2 has no reference.
  ci = study.paired_relative_ci({0: 1.1, 1: 2.2, 2: 9.0}, {0: 1.0, 1: 2.0})
  assert ci.n == 2
  assert ci.mean == pytest.approx(0.1)
  assert ci.half_width == pytest.approx(0.0, abs=1e-12)


def test_interpolate_crossing():
  curve = [(0.0, 5.0), (10.0, 3.0), (20.0, 1.0)]
  assert study.interpolate_crossing(curve, 2.0) == pytest.approx(15.0)  # Halfway from 3 to 1.
  assert study.interpolate_crossing(curve, 4.0) == pytest.approx(5.0)
  assert study.interpolate_crossing(curve, 5.0) == 0.0  # Already there at the first point.
  assert study.interpolate_crossing(curve, 1.0) == 20.0
  assert math.isinf(study.interpolate_crossing(curve, 0.5))


def test_markdown_table_exact_and_checked():
  text = study.markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
  assert text == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | y |"
  with pytest.raises(ValueError, match="3 cells"):
    study.markdown_table(["a", "b"], [[1, 2, 3]])


def test_reproduce_command_quotes_what_the_shell_would_split():
  cmd = study.reproduce_command("experiments/x.py", ["--seeds=0,1", "--binding=A = 1"])
  assert cmd == "python experiments/x.py --seeds=0,1 '--binding=A = 1'"


def test_system_bindings_and_validation():
  s = study.System(name="row", gin_files=("sim_tiny.gin",), bindings=("STEPS = 3",))
  assert s.all_bindings(7) == [
    "STEPS = 3",
    "RunConfig.seed = 7",
    "ClusterConfig.seed = 7",
    "TextDataConfig.seed = 7",
  ]
  assert s.signature(7)["gin_files"] == ["sim_tiny.gin"]
  with pytest.raises(ValueError, match="no gin files"):
    study.System(name="row", gin_files=())
  with pytest.raises(ValueError, match="seed"):
    study.System(name="row", gin_files=("a.gin",), seed_bindings=("RunConfig.seed = 1",))
  assert study.slug("K = 1 + grace (M = 4)") == "k_1_grace_m_4"


def test_result_store_round_trip_and_config_check(tmp_path):
  path = str(tmp_path / "s.json")
  a = study.System(name="a", gin_files=("x.gin",))
  store = study.ResultStore(path)
  store.put(a, 0, {"final_eval_loss": 2.0, "config": a.signature(0)})
  store.put(a, 1, {"final_eval_loss": 3.0, "config": a.signature(1)})
  again = study.ResultStore(path)
  assert [r["final_eval_loss"] for r in again.runs(a, [0, 1, 2])] == [2.0, 3.0]
  # Same name, other bindings: the stored results are not this system's.
  changed = study.System(name="a", gin_files=("x.gin",), bindings=("STEPS = 5",))
  assert again.get(changed, 0) is None
  assert again.runs(changed, [0, 1]) == []


def test_result_store_signed_by_the_resolved_configuration(tmp_path):
  # A fake resolution: the text of a "default" the files do not bind, which the test changes.
  default = {"lr": "0.4"}
  calls = []

  def resolve(files, bindings, *, search_paths):
    calls.append((tuple(files), tuple(bindings), tuple(search_paths)))
    return f"files {files} bindings {bindings} lr {default['lr']}"

  path = str(tmp_path / "s.json")
  a = study.System(name="a", gin_files=("x.gin",))
  store = study.ResultStore(path, resolve=resolve, gin_root="root")
  digest = study.configuration_digest(a, 0, resolve=resolve, gin_root="root")
  store.put(
    a, 0, {"final_eval_loss": 2.0, "config": a.signature(0), "configuration_sha256": digest}
  )
  store.put(a, 1, {"final_eval_loss": 3.0, "config": a.signature(1)})  # Stored before signing.
  again = study.ResultStore(path, resolve=resolve, gin_root="root")
  assert again.get(a, 0)["final_eval_loss"] == 2.0
  assert again.get(a, 1) is None and again.stored(a, 1)["final_eval_loss"] == 3.0
  assert calls[0] == (("root/x.gin",), tuple(a.all_bindings(0)), ("root",))
  # Resolved once per process, however many stores ask.
  assert len([c for c in calls if c[1] == tuple(a.all_bindings(0))]) == 1
  # A changed default (the same files and bindings) makes the stored result stale.
  default["lr"] = "0.7"
  study._CONFIGURATIONS.clear()
  assert study.ResultStore(path, resolve=resolve, gin_root="root").get(a, 0) is None
  assert study.ResultStore(path).get(a, 0)["final_eval_loss"] == 2.0  # Unsigned comparison.
  study._CONFIGURATIONS.clear()


def test_one_tiny_run_and_a_failing_row(tmp_path, capsys):
  from ddiloco.launch import configurables

  run = {"simulate_files": configurables.simulate_files, "gin_root": GIN_ROOT}
  fast = (
    "LEARNERS = 2",
    "STEPS = 3",
    "InnerOptConfig.warmup_steps = 1",
    "RunConfig.eval_every_s = 1.5",
    "RunConfig.eval_batches = 1",
    "FAULTS = ()",
  )
  good = study.System(name="tiny", gin_files=("sim_tiny.gin",), bindings=fast)
  bad = study.System(name="broken", gin_files=("no_such_file.gin",))
  resolve = configurables.resolved_config
  store = study.ResultStore(str(tmp_path / "r.json"), resolve=resolve, gin_root=GIN_ROOT)
  study.run_grid([(bad, [0]), (good, [0])], store=store, workdir=str(tmp_path / "runs"), **run)
  assert "[broken seed 0] FAILED" in capsys.readouterr().err
  assert store.get(bad, 0) is None
  result = store.get(good, 0)
  assert result["tokens_trained"] == 2 * 3 * 8 * 64  # LEARNERS x STEPS x BATCH x SEQ_LEN
  assert result["goodput"] == pytest.approx(1.0)
  assert result["final_eval_loss"] < 6.0
  # (time, tokens, loss) per eval: at 1.5 s after 1 step (2 x 8 x 64 = 1,024 tokens), at 3.0 s
  # before the third step lands (it was queued after the eval), then the final one after the drain.
  curve = result["curve"]
  assert [c[:2] for c in curve[:2]] == [[1.5, 1024], [3.0, 2048]]
  assert len(curve) == 3 and curve[-1][1:] == [3072, result["final_eval_loss"]]
  assert sorted(result["learners"]) == ["0", "1"]
  assert result["busy_learner_s"] == pytest.approx(result["provisioned_learner_s"])
  # Signed with the configuration it resolved to, whose text is kept beside the run.
  text = study.configuration(good, 0, resolve=resolve, gin_root=GIN_ROOT)
  assert "SyncerConfig.ema_decay = 0.8" in text  # A default no gin file binds.
  with open(os.path.join(result["workdir"], "configuration.gin")) as f:
    assert f.read() == text
  assert result["configuration_sha256"] == study.configuration_digest(
    good, 0, resolve=resolve, gin_root=GIN_ROOT
  )
  # A second grid run finds it stored and does not run it again.
  study.run_grid([(good, [0])], store=store, workdir=str(tmp_path / "runs"), **run)
  assert "stored, skipped" in capsys.readouterr().err
  # Resolved to another configuration (a default changed), it is run again.
  other = study.ResultStore(
    store.path, resolve=lambda *a, **k: resolve(*a, **k) + "#", gin_root=GIN_ROOT
  )
  assert other.get(good, 0) is None
  study.run_grid([(good, [0])], store=other, workdir=str(tmp_path / "runs"), **run)
  assert "stored with another configuration: run again" in capsys.readouterr().err
  assert other.get(good, 0) is not None


def test_publish_writes_the_table_and_the_figure(tmp_path, capsys):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots()
  ax.plot([0, 1], [1, 0])
  path = study.publish(str(tmp_path), "demo", "| a |\n|---|\n| 1 |\n", fig, "python demo.py")
  assert path == str(tmp_path / "demo.md")
  assert (tmp_path / "demo.md").read_text() == "| a |\n|---|\n| 1 |\n"
  assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "reproduce: python demo.py" in capsys.readouterr().out
  assert not plt.fignum_exists(fig.number)  # Closed.
