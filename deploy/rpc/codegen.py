"""Generate the gRPC Python modules from specfleet.proto with grpcio-tools: `python -m deploy.rpc.codegen`.

The modules land beside the proto (deploy/rpc/specfleet_pb2.py, specfleet_pb2_grpc.py; git-ignored) and
import each other as `deploy.rpc.*`, because protoc runs from the folder that holds `deploy/`. `ensure()` is
called before anything imports them (the API, the CLI, tests); container images run this module at build time.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "specfleet.proto"
OUTPUTS = (HERE / "specfleet_pb2.py", HERE / "specfleet_pb2_grpc.py")
SERVICER_FUNCTION = "deploy.rpc.specfleet_pb2_grpc.add_SpecfleetServicer_to_server"


def generate() -> None:
    from grpc_tools import protoc  # build-time tool, imported only when generating

    root = HERE.parent.parent  # the folder holding the `deploy` package
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}", f"--pyi_out={root}",
            f"--grpc_python_out={root}", str(PROTO.relative_to(root))]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def ensure() -> None:
    """Generate the modules if they are missing or older than the proto."""
    if not all(p.exists() and p.stat().st_mtime >= PROTO.stat().st_mtime for p in OUTPUTS):
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated {', '.join(str(p) for p in OUTPUTS)}", file=sys.stderr)
