#!/usr/bin/env bash
# Regenerates ddiloco/transport/proto/syncer_pb2.py and syncer_pb2_grpc.py from syncer.proto.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]
#   OUT_DIR defaults to the repository root (i.e. overwrite the committed files); the files land in
#   OUT_DIR/ddiloco/transport/proto/. PYTHON selects the interpreter (default: .venv/bin/python if
#   present, else python3); it needs grpcio-tools (the "test" extra of setup.py).
# tests/transport/proto_test.py runs this into a temporary dir and compares with the committed files.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
REL=ddiloco/transport/proto

mkdir -p "$OUT/$REL"
cd "$ROOT"
# -I . makes the descriptor's file name "ddiloco/transport/proto/syncer.proto": unique in the global
# protobuf descriptor pool, and independent of the working directory.
"$PYTHON" -m grpc_tools.protoc -I . \
  --python_out="$OUT" --grpc_python_out="$OUT" \
  "$REL/syncer.proto"
# Package-relative import of the messages, so the generated package works wherever it is installed.
sed -i 's/^from ddiloco\.transport\.proto import syncer_pb2 as /from . import syncer_pb2 as /' \
  "$OUT/$REL/syncer_pb2_grpc.py"
grep -q '^from \. import syncer_pb2 as ' "$OUT/$REL/syncer_pb2_grpc.py" || {
  echo "gen_proto.sh: could not rewrite the syncer_pb2 import in syncer_pb2_grpc.py" >&2
  exit 1
}
