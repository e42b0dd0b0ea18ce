"""Generated gRPC/protobuf code for the syncer service (regenerate with scripts/gen_proto.sh)."""
