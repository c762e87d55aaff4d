"""What a program that calls a stageserve system imports: ``stageserve.client``, the typed gRPC
client of ``stageserve.v1.Router``, and ``PROTO_ROOT``, the gRPC contracts as installed.

The servers are the ``services`` package (``stageserve up``); nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

import services.common.pb as _pb

# The import root of the installed .proto files: stageserve/v1/router.proto is the public API
# (grpcurl -import-path PROTO_ROOT -proto stageserve/v1/router.proto, or protoc -I PROTO_ROOT).
PROTO_ROOT = Path(_pb.__file__).parent
