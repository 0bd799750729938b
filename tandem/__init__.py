"""Python code generated from `protos/` by `make protos` (grpc_tools.protoc); never edited."""
