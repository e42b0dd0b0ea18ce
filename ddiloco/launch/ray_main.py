"""`ddiloco-ray`: the job of `ddiloco-local` on a Ray cluster (launch/ray_cluster.py).

  ddiloco-ray --gin_file=gin_configs/ray_tiny.gin --workdir=workdirs/ray_tiny [--address=auto]

Without `--address` (or `RayConfig.address`, or RAY_ADDRESS) it starts a Ray instance on this
machine for the run and stops it afterwards. The syncer runs as an actor on the head node, each
learner as one actor per process of its slice; Ray restarts a program that dies, alone, and the
others never stop. Flags, progress lines, `ddiloco-fleet`, summary.json and loss.png are those of
`ddiloco-local`; summary.json's "membership" also lists every restart Ray made.
"""

from absl import app, flags

from ddiloco.launch import cli, local

_ADDRESS = flags.DEFINE_string(
  "address", None, "Ray cluster to join (overrides RayConfig.address; 'auto': the local one)"
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from ddiloco.launch import configurables, gin_flags

  try:
    from ddiloco.launch import ray_cluster
  except ImportError as e:  # Ray is an extra; the message says how to install it.
    cli.fail("ddiloco-ray", str(e))

  if _ADDRESS.value is not None:  # A gin binding, checked and forwarded like the others.
    gin_flags.add_bindings([f"ddiloco.RayConfig.address = {_ADDRESS.value!r}"])

  def make_cluster(*, backend_config, **kwargs):
    return ray_cluster.make_cluster(ray_config=backend_config, **kwargs)

  local.run_job(
    "ddiloco-ray",
    make_cluster,
    backend_config=configurables.configured(ray_cluster.RayConfig),
    before_run=lambda cluster: cluster.backend.connect(),
    after_run=lambda cluster: cluster.backend.disconnect(),
  )


def run() -> None:
  """Console-script entry point."""
  cli.run(main, prog="ddiloco-ray", module=__name__, shared_flags=[local.__name__])


if __name__ == "__main__":
  run()
