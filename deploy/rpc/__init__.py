"""The gRPC API: deploy/rpc/specfleet.proto and the modules generated from it (see codegen.py)."""
