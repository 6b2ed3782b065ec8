"""Generated gRPC/protobuf stubs for pdserve.proto (regenerate with `python -m
pdserve.disagg.proto.generate`; a test checks they match the .proto)."""
