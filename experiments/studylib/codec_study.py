"""The compression study's pieces (experiments/compression_quality.py): codec entries, paired
ratios, the verdict on the compression goal, the table and the figure.

Kept out of the script, which defines absl flags, so tests can import them in one process with
every other module (two modules defining the same flag name cannot both be imported).
"""

import os
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddiloco.fragments.compression import CODECS

from . import study

STUDY = "compression"
HEADLINE = ("bf16", "int4")
EXTRA = ("fp32", "int8")
# sim_small's model and fleet, 96 steps of 4 x 64 per learner.
DEFAULT_BINDINGS = (
  "STEPS=96",
  "BATCH=4",
  "DP_BATCH=16",
  "SEQ_LEN=64",
  # The outer step the stored rows ran with (DiLoCo's Nesterov 0.7 / 0.9), whatever the default.
  "SyncerConfig.outer_optimizer = @outer/optax.sgd",
  "outer/optax.sgd.learning_rate = 0.7",
  "outer/optax.sgd.momentum = 0.9",
  "outer/optax.sgd.nesterov = True",
)
# A few steps without the crash, one eval batch: checks the wiring, not the numbers.
QUICK_BINDINGS = (
  "STEPS = 4",
  "FAULTS = ()",
  "InnerOptConfig.warmup_steps = 1",
  "RunConfig.eval_batches = 1",
)
GOAL = 1.005  # The goal: int4 eval loss within 0.5 % of bf16.
RATIOS = (("int4", "bf16"), ("int8", "bf16"), ("bf16", "fp32"), ("int4", "fp32"))


def parse_codec(spec: str) -> tuple[str, str, int | None]:
  """Splits a codec entry `UP[/DOWN][@BLOCK]` into (uplink, downlink, block size or None).

  Raises:
    ValueError: for an unknown codec or a block size that is not a positive integer.
  """
  codecs, _, block = spec.partition("@")
  up, _, down = codecs.partition("/")
  down = down or up
  for codec in (up, down):
    if codec not in CODECS:
      raise ValueError(f"Unknown codec {codec!r} in {spec!r}; expected one of {CODECS}.")
  if not block:
    return up, down, None
  if not block.isdigit() or int(block) < 1:
    raise ValueError(f"Block size in {spec!r} must be a positive integer.")
  return up, down, int(block)


def codec_system(spec: str, *, run_file: str, bindings: Sequence[str]) -> study.System:
  """The study row of one codec entry: the run file, `bindings`, then the codec bindings.

  Args:
    spec: a codec entry, see `parse_codec`; also the row's name.
    run_file: the run gin file, relative to the gin root.
    bindings: gin bindings applied before the codec's.
  """
  up, down, block = parse_codec(spec)
  codec = [f"ServiceConfig.uplink_codec = '{up}'", f"ServiceConfig.downlink_codec = '{down}'"]
  if block is not None:
    codec.append(f"ServiceConfig.block_size = {block}")
  return study.System(name=spec, gin_files=(run_file,), bindings=(*bindings, *codec))


def gin_relative(path: str, gin_root: str = "gin_configs") -> str:
  """`path` relative to the gin root when it lies under it (the store's signature stays portable)."""
  rel = os.path.relpath(os.path.abspath(path), os.path.abspath(gin_root))
  return os.path.abspath(path) if rel.startswith("..") else rel


def paired_ratio(values: Mapping[int, float], reference: Mapping[int, float]) -> study.Interval:
  """Mean and 95 % t-interval of values[s] / reference[s] over the seeds present in both."""
  rel = study.paired_relative_ci(values, reference)
  return study.Interval(1.0 + rel.mean, rel.half_width, rel.n)


def verdict(ratio: study.Interval, goal: float = GOAL) -> str:
  """The verdict of a ratio interval against `goal` (e.g. int4 / bf16 <= 1.005)."""
  if ratio.n == 0:
    return "not run"
  if ratio.n == 1:
    return "inconclusive at 1 seed"
  if ratio.mean + ratio.half_width <= goal:
    return "met"
  if ratio.mean - ratio.half_width > goal:
    return "not met"
  return f"inconclusive at {ratio.n} seeds"


def ratio_row(name: str, values: Mapping[int, float], reference: Mapping[int, float]) -> list:
  """One row of the ratio table: name, mean ± half-width, [low, high], seeds, verdict."""
  r = paired_ratio(values, reference)
  if r.n == 0:
    return [name, "–", "–", 0, "not run"]
  span = "–" if r.n < 2 else f"[{r.mean - r.half_width:.4f}, {r.mean + r.half_width:.4f}]"
  return [name, r.format(4), span, r.n, verdict(r)]


def codec_row(spec: str, runs: Mapping[int, Mapping[str, Any]]) -> list:
  """One row of the per-codec table from its stored runs ({seed: result})."""
  up, down, block = parse_codec(spec)
  wire = up if up == down else f"{up} up / {down} down"
  if block is not None:
    wire += f", blocks of {block}"
  if not runs:
    return [spec, wire, "not run", 0, "–", "–", "–", "–"]
  seeds = sorted(runs)
  loss = [runs[s]["final_eval_loss"] for s in seeds]
  return [
    spec,
    wire,
    study.mean_ci(loss).format(4),
    len(seeds),
    ", ".join(f"{s}: {v:.4f}" for s, v in zip(seeds, loss, strict=True)),
    " / ".join(str(runs[s]["merges"]) for s in seeds),
    all(runs[s]["digests_agree"] for s in seeds),
    f"{study.mean_ci([runs[s]['elapsed_s'] for s in seeds]).mean:.0f}",
  ]


def report_markdown(
  runs: Mapping[str, Mapping[int, Mapping[str, Any]]], *, command: str, setup: str
) -> str:
  """The study's table: per-codec losses and paired ratios with verdicts.

  Args:
    runs: {codec entry: {seed: stored result}}.
    command: the command that reproduces the table.
    setup: one line on the run file and bindings.
  """
  loss = {
    spec: {s: r["final_eval_loss"] for s, r in by_seed.items()} for spec, by_seed in runs.items()
  }
  ratio_rows = [
    ratio_row(f"{a} / {b}", loss[a], loss[b]) for a, b in RATIOS if a in loss and b in loss
  ]
  # Extra entries (one direction, other block sizes) against bf16, the goal's reference.
  ratio_rows += [
    ratio_row(f"{spec} / bf16", loss[spec], loss["bf16"])
    for spec in runs
    if spec not in CODECS and "bf16" in loss
  ]
  return "\n".join(
    [
      "# Quality cost of compression on the wire",
      "",
      setup,
      "Both directions in one codec unless the row says otherwise (docs/algorithm.md §5). Final held-out eval",
      "loss of the global model, mean ± 95 % Student-t interval over seeds; ratios are per seed",
      f'(paired), then averaged. Goal: int4 / bf16 <= {GOAL}; "met" when the interval\'s upper',
      'end is within it, "not met" when its lower end is above it, inconclusive otherwise.',
      "",
      "Reproduce (runs only what the store lacks; add --tier=report to rewrite this page only):",
      "",
      f"    {command}",
      "",
      "## Eval loss per codec",
      "",
      study.markdown_table(
        [
          "codec",
          "wire",
          "eval loss",
          "seeds",
          "per seed",
          "merges",
          "digests agree",
          "wall s / run",
        ],
        [codec_row(spec, by_seed) for spec, by_seed in runs.items()],
      ),
      "",
      "## Paired ratios",
      "",
      study.markdown_table(
        ["ratio", "mean ± 95 % t", "95 % interval", "seeds", f"<= {GOAL}?"], ratio_rows
      ),
      "",
      f"![eval loss per codec]({STUDY}.png)",
    ]
  )


def ratio_figure(loss: Mapping[str, Mapping[int, float]]) -> Any:
  """Per-seed final losses per codec (left) and per-seed paired ratios with their intervals (right).

  The eval curves have only a few points at this run length, so the figure shows what the table
  is about: the spread over seeds and where each ratio's interval lies against the goal.
  """
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
  for i, by_seed in enumerate(loss.values()):
    left.plot([i] * len(by_seed), list(by_seed.values()), "o", color=f"C{i % 10}", alpha=0.7)
  left.set_xticks(range(len(loss)), list(loss))
  left.set_ylabel("final held-out loss (one dot per seed)")
  pairs = [(a, b) for a, b in RATIOS if loss.get(a) and loss.get(b)]
  for i, (a, b) in enumerate(pairs):
    seeds = sorted(set(loss[a]) & set(loss[b]))
    right.plot([i] * len(seeds), [loss[a][s] / loss[b][s] for s in seeds], "o", color="0.6")
    r = paired_ratio(loss[a], loss[b])
    if r.n >= 2:
      right.errorbar([i + 0.15], [r.mean], yerr=[r.half_width], fmt="s", color="C3", capsize=4)
  right.axhline(1.0, color="0.3", lw=0.8)
  right.axhline(GOAL, color="C3", ls="--", lw=0.8, label=f"goal {GOAL}")
  right.set_xticks(range(len(pairs)), [f"{a}/{b}" for a, b in pairs])
  right.set_ylabel("paired ratio (dots: seeds; square: mean ± 95 % t)")
  right.legend(fontsize=7)
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def plan_for(specs: Sequence[str], tier: str) -> list[str]:
  """The codec entries of `specs` that `tier` runs, in order (the caller interleaves seeds)."""
  if tier == "report":
    return []
  if tier in ("quick", "headline"):
    wanted = HEADLINE
  elif tier == "extra":
    wanted = EXTRA
  else:
    wanted = HEADLINE + EXTRA
  # Named codecs in tier order, then entries outside CODECS (diagnostics) with "all".
  out = [c for c in wanted if c in specs]
  if tier == "all":
    out += [s for s in specs if s not in CODECS]
  return out
