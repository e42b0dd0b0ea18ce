"""What a simulated run writes and reports: its events and scalars, progress line and summary."""

from typing import TYPE_CHECKING, Any

import numpy as np

from ddiloco.metrics import progress as progress_fields

if TYPE_CHECKING:
  from ddiloco.simulation.cluster import SimulatedCluster
  from ddiloco.syncer.core import MergeEvent


def _event(sim: "SimulatedCluster", kind: str, **fields: Any) -> None:
  if sim.writer is not None:
    sim.writer.event(kind, time=round(sim.now, 6), **fields)


def _scalars(sim: "SimulatedCluster", values: dict[str, float], *, step: int | None = None) -> None:
  """TensorBoard scalars against the fleet's tokens trained (metrics/writer.py)."""
  if sim.writer is not None:
    sim.writer.scalars(values, tokens=sim.tokens_trained, step=step)


def record_train(sim: "SimulatedCluster", slot, step_time: float) -> None:
  """A logged step of slot's learner: its loss and step rate."""
  step = slot.learner.kernel.step
  loss = float(slot.last_metrics["loss"])
  slot.losses.append(loss)
  _event(sim, "train", learner=slot.index, step=step, loss=loss, tokens=slot.tokens_done)
  # Steps per virtual second: a slowdown or a straggler shows here.
  rate = 1.0 / step_time if step_time > 0 else 0.0
  _scalars(
    sim,
    {f"learner_{slot.index}/loss": loss, f"learner_{slot.index}/step_rate": rate},
    step=step,
  )


def record_merge(sim: "SimulatedCluster", ev: "MergeEvent") -> None:
  """A published merge (booked in `sim.merge_events` already)."""
  _event(sim, "merge", **ev.log_fields())
  _scalars(
    sim,
    {
      "syncer/merges": len(sim.merge_events),
      "syncer/quorum_size": len(ev.contributors),
      "syncer/grace_window_s": ev.grace_s,
    },
  )


def record_eval(sim: "SimulatedCluster", *, final: bool = False) -> float:
  """Evaluates the global model now, books and writes it (with the run's goodput and traffic so
  far) and returns the loss. The final one closes the goodput ledger's books."""
  loss = sim.factory.evaluate_flat(sim.global_params_flat())
  sim.evals.append((sim.now, loss))
  # The last evaluation's other metrics (e.g. accuracy, moe_aux_loss).
  aux = {k: float(v) for k, v in (sim.factory.last_eval or {}).items() if k != "loss"}
  _event(
    sim, "eval", loss=loss, tokens=sim.tokens_trained, **({"final": True} if final else {}), **aux
  )
  _scalars(
    sim,
    {
      "eval/loss": loss,
      **{f"eval/{k}": v for k, v in aux.items()},
      "goodput/goodput": sim.ledger.goodput() if final else sim.ledger.goodput(sim.now),
      "goodput/global_downtime_s": sim.ledger.global_downtime_s,
      "traffic/bytes_up": sim.bytes_up,
      "traffic/bytes_down": sim.bytes_down,
    },
  )
  return loss


def progress_line(sim: "SimulatedCluster", wall_s: float | None = None) -> str:
  """One status line; with `wall_s` (real seconds since the start) also the real steps/s,
  tokens/s and the ETA of the token budget at that pace."""
  versions = sum(sim.core.version(p) for p in range(sim.layout.num_fragments)) if sim.core else 0
  parts = [
    progress_fields.learner(
      slot.index,
      "up" if slot.alive else "down",
      slot.learner.kernel.step if slot.learner else 0,
      slot.losses[-1] if slot.losses else None,
    )
    for slot in sim.slots.values()
  ]
  steps_per_s = tokens_per_s = eta_s = None
  if wall_s and wall_s > 0 and sim.tokens_trained > 0:
    steps_per_s = sum(slot.steps_done for slot in sim.slots.values()) / wall_s
    tokens_per_s = sim.tokens_trained / wall_s
    eta_s = max(0, sim.token_budget - sim.tokens_trained) / tokens_per_s
  pct = 100.0 * sim.tokens_trained / sim.token_budget
  return (
    f"t={sim.now:8.1f}s tokens {pct:5.1f}% merges {len(sim.merge_events)} v_sum {versions} | "
    f"{progress_fields.throughput(steps_per_s, tokens_per_s, eta_s)} | " + " ".join(parts)
  )


def digests_agree(sim: "SimulatedCluster") -> bool:
  """Every alive learner holds, for each fragment at its anchor == current version, the same bits."""
  if sim.core is None:
    return True
  for slot in sim.slots.values():
    if not slot.alive:
      continue
    for p in range(sim.layout.num_fragments):
      state = sim.core.state(p)
      held_now = slot.learner.kernel.anchor[p] == state.version
      if held_now and slot.learner.device.applied_digest[p] != state.digest:
        return False
  return True


def _settle(sim: "SimulatedCluster", slot) -> None:
  """The learner hears the syncer's final versions and merged steps (ledger.py), as a last
  heartbeat would tell it."""
  versions = [sim.core.version(p) for p in range(sim.layout.num_fragments)]
  slot.learner.kernel.ledger.settle(versions, sim.core.merged_steps(slot.index))


def summary(sim: "SimulatedCluster", final_loss: float, wall_s: float) -> dict[str, Any]:
  """The run's summary (simulate() writes it to summary.json)."""
  stats = sim.syncer.stats() if sim.syncer is not None else {}
  if sim.core is not None:
    for slot in sim.slots.values():
      if slot.learner is not None:
        _settle(sim, slot)
  quorums = [len(ev.contributors) for ev in sim.merge_events]
  return {
    "final_eval_loss": final_loss,
    "tokens_trained": sim.tokens_trained,
    "goodput": sim.ledger.goodput(),
    "global_downtime_s": sim.ledger.global_downtime_s,
    "merges": len(sim.merge_events),
    "mean_quorum_size": float(np.mean(quorums)) if quorums else 0.0,
    "dropped_reports": int(stats.get("late", 0)) + sim.lost_reports,
    "bytes_up": sim.bytes_up,
    "bytes_down": sim.bytes_down,
    "wall_time_s": wall_s,
    "virtual_time_s": sim.now,
    "digests_agree": digests_agree(sim),
    "token_budget": sim.token_budget,
    "budget_reached": sim.tokens_trained >= sim.token_budget,
    "stalled": sim.stalled,
    "learners": {
      str(s.index): {
        "steps": s.steps_done,
        "tokens": s.tokens_done,
        "time": sim.ledger.totals(s.index),
        # The positions it read (slot.py; launch/run_summary.py `data_segments`).
        "data": s.data_summary(),
        **(
          {
            "token_ledger": s.learner.kernel.ledger.totals(),
            "carried_applies": s.learner.kernel.answers.carried,
          }
          if s.learner is not None
          else {}
        ),
      }
      for s in sim.slots.values()
    },
    "syncer": stats,
    "token_ledger": sim.core.ledger() if sim.core is not None else {},
    "evals": [[round(t, 4), loss] for t, loss in sim.evals],
  }
