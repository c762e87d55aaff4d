"""The committed stubs in services/common/pb are exactly what scripts/gen_protos.py makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PB_DIR = REPO_ROOT / "services" / "common" / "pb"
REGENERATE = "python scripts/gen_protos.py"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    out = tmp_path / "pb"
    run = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"gen_protos.py failed:\n{run.stdout}{run.stderr}"
    fresh, committed = _tree(out), _tree(PB_DIR)
    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    differ = sorted(k for k in fresh.keys() & committed.keys() if fresh[k] != committed[k])
    assert not (missing or extra or differ), (
        f"stale stubs in services/common/pb (missing {missing}, extra {extra}, differ {differ}); "
        f"run `{REGENERATE}` and commit the result"
    )


def test_stubs_import_as_package() -> None:
    from services.common.pb.stageserve.v1 import decode_pb2, router_pb2_grpc

    assert decode_pb2.DESCRIPTOR.package == "stageserve.v1"
    assert hasattr(router_pb2_grpc, "RouterStub")


def test_messages_carry_no_opaque_payloads() -> None:
    from google.protobuf.descriptor import FieldDescriptor

    from services.common.pb.stageserve.v1 import (
        common_pb2,
        decode_pb2,
        prefill_pb2,
        router_pb2,
        tokenizer_pb2,
        vision_encoder_pb2,
    )

    allowed_bytes = {
        "stageserve.v1.ImageData.data",
        "stageserve.v1.ImageInput.data",
        "stageserve.v1.EncodeSpan.image_data",
        # MACs and nonces of the KV path (services/common/signing.py): 16 or 32 bytes, never a
        # payload
        "stageserve.v1.KvRef.nonce",
        "stageserve.v1.KvRef.mac",
        "stageserve.v1.PrefillResponse.kv_written_proof",
        "stageserve.v1.DecodeGenerateRequest.kv_written_proof",
        # prompt embeddings a client sends (torch.save, loaded weights-only by the router) and their
        # rows on to prefill (raw little-endian, shape and dtype checked); bounded by the body limit
        "stageserve.v1.GenerateRequest.prompt_embeds",
        "stageserve.v1.PrefillRequest.prompt_embeds",
    }
    modules = (common_pb2, decode_pb2, prefill_pb2, router_pb2, tokenizer_pb2, vision_encoder_pb2)
    for module in modules:
        assert not module.DESCRIPTOR.dependencies or all(
            d.package == "stageserve.v1" for d in module.DESCRIPTOR.dependencies
        ), f"{module.__name__} imports a non-stageserve proto (Any/Struct?)"
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                if field.type == FieldDescriptor.TYPE_BYTES:
                    assert field.full_name in allowed_bytes, (
                        f"unexpected bytes field {field.full_name}"
                    )


def test_every_proto_element_has_a_comment(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PB_DIR).as_posix() for p in PB_DIR.rglob("*.proto"))
    out = tmp_path / "set.pb"
    args = [
        "protoc",
        f"-I{PB_DIR}",
        "--include_source_info",
        f"--descriptor_set_out={out}",
        *protos,
    ]
    assert protoc.main(args) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    undocumented = []
    for file in files:
        comments = {
            tuple(loc.path): loc.leading_comments.strip()
            for loc in file.source_code_info.location
            if loc.leading_comments.strip()
        }
        for path, name in _documentable(file):
            if path not in comments:
                undocumented.append(f"{file.name}: {name}")
    assert not undocumented, f"elements without a leading comment: {undocumented}"


def _documentable(file: Any) -> list[tuple[tuple[int, ...], str]]:
    # Source-info paths: 4 = message_type, 2 = field, 3 = nested_type, 4 = enum_type
    # (in a message), 5 = enum_type (top level), 2 = value, 6 = service, 2 = method.
    found: list[tuple[tuple[int, ...], str]] = []

    def message(path: tuple[int, ...], msg: Any) -> None:
        found.append((path, msg.name))
        found.extend(((*path, 2, i), f"{msg.name}.{f.name}") for i, f in enumerate(msg.field))
        for i, nested in enumerate(msg.nested_type):
            message((*path, 3, i), nested)
        for i, enum in enumerate(msg.enum_type):
            enum_values((*path, 4, i), enum)

    def enum_values(path: tuple[int, ...], enum: Any) -> None:
        found.append((path, enum.name))
        found.extend(((*path, 2, i), f"{enum.name}.{v.name}") for i, v in enumerate(enum.value))

    for i, msg in enumerate(file.message_type):
        message((4, i), msg)
    for i, enum in enumerate(file.enum_type):
        enum_values((5, i), enum)
    for i, service in enumerate(file.service):
        found.append(((6, i), service.name))
        found.extend(
            ((6, i, 2, j), f"{service.name}.{m.name}") for j, m in enumerate(service.method)
        )
    return found
