"""The package layering of docs/architecture.md ("Layers"), read from the sources' imports."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ddiloco"
# Pure packages: no sockets, threads or processes (those live in service/, learner_process/,
# launch/, chaos/).
PURE = ("syncer", "learner", "fragments", "simulation", "models", "faults")
IMPURE_MODULES = ("grpc", "threading", "subprocess")


def _imports(path: pathlib.Path) -> list[str]:
  out = []
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.append(node.module)
  return out


def _package_graph() -> dict[str, set[str]]:
  """{package: the other ddiloco packages its modules import}."""
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT).parts
    if len(parts) < 2:
      continue  # ddiloco/__init__.py, ddiloco/protocol.py: shared by every package.
    for name in _imports(path):
      bits = name.split(".")
      other = bits[1] if bits[0] == "ddiloco" and len(bits) > 1 else None
      if other is not None and other != parts[0] and (ROOT / other).is_dir():
        graph[parts[0]].add(other)
  return graph


def test_pure_packages_import_no_grpc_threads_or_processes():
  offenders = []
  for pkg in PURE:
    for path in (ROOT / pkg).rglob("*.py"):
      for name in _imports(path):
        if name.split(".")[0] in IMPURE_MODULES:
          offenders.append(f"{path.relative_to(ROOT)} imports {name}")
  assert offenders == []


def test_no_import_cycle_between_packages():
  graph = _package_graph()
  cycles = []
  for a in sorted(graph):
    for b in sorted(graph[a]):
      seen, stack = set(), [b]
      while stack:
        x = stack.pop()
        if x == a:
          cycles.append(f"{a} -> {b} -> ... -> {a}")
          break
        if x not in seen:
          seen.add(x)
          stack.extend(graph.get(x, ()))
  assert cycles == []


def test_the_pure_core_never_imports_the_runtime():
  graph = _package_graph()
  for pkg in ("syncer", "fragments", "models", "learner"):
    assert not graph[pkg] & {"service", "learner_process", "launch", "chaos", "transport"}, pkg


def test_the_library_never_imports_its_test_helpers():
  offenders = []
  for path in ROOT.rglob("*.py"):
    if path.relative_to(ROOT).parts[0] == "testing":
      continue
    offenders += [
      f"{path.relative_to(ROOT)} imports {n}"
      for n in _imports(path)
      if n.startswith("ddiloco.testing")
    ]
  assert offenders == []


def test_only_the_entry_points_import_gin():
  """The library is plain Python; launch/configurables.py registers it with gin (as t5x keeps its
  library free of gin)."""
  offenders = [
    f"{path.relative_to(ROOT)} imports {name}"
    for path in ROOT.rglob("*.py")
    if path.relative_to(ROOT).parts[0] != "launch"
    for name in _imports(path)
    if name.split(".")[0] == "gin"
  ]
  assert offenders == []


MAX_LINES = 500


def test_no_module_of_ours_is_over_500_lines():
  """Modules are split by concern long before this; generated protobuf code is not ours."""
  over = [
    f"{path.relative_to(ROOT)}: {n}"
    for path in ROOT.rglob("*.py")
    if "_pb2" not in path.name and (n := len(path.read_text().splitlines())) > MAX_LINES
  ]
  assert over == []


# The learner's protocol kernel and the parts it composes: numpy only (docs/architecture.md).
KERNEL = ("kernel", "held", "rounds", "ledger", "carry", "config")
KERNEL_FORBIDDEN = ("jax", "flax", "optax", "threading", "socket", "time", "grpc")


def test_the_learner_kernel_imports_no_jax_threads_sockets_or_clocks():
  offenders = [
    f"learner/{name}.py imports {imported}"
    for name in KERNEL
    for imported in _imports(ROOT / "learner" / f"{name}.py")
    if imported.split(".")[0] in KERNEL_FORBIDDEN
    or (imported.startswith("ddiloco.learner.") and imported.split(".")[2] not in KERNEL)
  ]
  assert offenders == []
