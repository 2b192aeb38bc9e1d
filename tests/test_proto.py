"""The generated stubs match proto/, and proto/ matches the contract in API.md.

The names below are copied from ../shared/API.md (the binding contract): a rename in the
.proto that an engine would notice fails here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

from hicache.pb.hicache.v1 import admin_pb2, admin_pb2_grpc, hicache_pb2, hicache_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

# A field spec: name -> None (a scalar) or the nested message's own spec; a trailing "[]"
# marks a repeated field.
Spec = Mapping[str, Any]

MEMBER_PAGES: Spec = {"member": None, "page_ids": None}

# service -> RPC -> (request fields, response fields), as API.md lists them.
API: dict[str, dict[str, tuple[Spec, Spec]]] = {
    "HiCache": {
        "Attach": (
            {"engine_id": None, "tp_rank": None, "tp_size": None},
            {
                "page_size": None,
                "members[]": {
                    "name": None, "component": None, "anchor": None, "layers": None,
                    "bytes_per_page_per_layer": None, "window_tokens": None,
                },
                "pools[]": {
                    "member": None, "tp_rank": None, "kind": None, "handle": None,
                    "device": None, "num_pages": None, "layer_stride_bytes": None,
                    "page_stride_bytes": None,
                },
                "lease_ms": None,
            },
        ),
        "Heartbeat": (
            {"engine_id": None},
            {"lease_ms": None, "locks": None, "allocations": None},
        ),
        "MatchPrefix": (
            {
                "namespace": None, "tokens": None, "session_id": None, "request_id": None,
                "lock": None, "prefetch": None, "allocate_tokens": None,
            },
            {
                "device_tokens": None, "host_tokens": None, "storage_tokens": None,
                "device_pages[]": MEMBER_PAGES, "lock_id": None, "prefetch_id": None,
                "allocation_id": None, "pages[]": MEMBER_PAGES,
            },
        ),
        "Load": (
            {"lock_id": None},
            {
                "layers_ready": None, "layers_total": None, "device_pages[]": MEMBER_PAGES,
                "device_tokens": None,
            },
        ),
        "PrefetchStatus": (
            {"prefetch_id": None},
            {"state": None, "tokens_ready": None, "tokens_total": None},
        ),
        "CancelPrefetch": ({"prefetch_id": None}, {"tokens_ready": None}),
        "Allocate": (
            {"namespace": None, "num_tokens": None, "lock_id": None, "allocation_id": None},
            {"allocation_id": None, "pages[]": MEMBER_PAGES},
        ),
        "Insert": (
            {
                "namespace": None, "tokens": None, "lock_id": None, "allocation_id": None,
                "session_id": None, "request_id": None, "mamba_checkpoint": None,
                "keep_lock": None,
            },
            {"inserted_tokens": None, "reused_tokens": None},
        ),
        "Release": ({"lock_id": None, "allocation_id": None}, {}),
        "CloseSession": ({"session_id": None}, {"released_refs": None}),
        "Batch": ({"ops[]": {}}, {"results[]": {}}),
        "Stats": (
            {},
            {"pools[]": {"capacity_pages": None, "used_pages": None, "locked_pages": None}},
        ),
    },
    "Admin": {
        "Health": (
            {"deep": None},
            {
                "backends[]": {
                    "name": None, "healthy": None, "latency_ms": None, "detail": None,
                    "capacity_bytes": None, "used_bytes": None,
                },
            },
        ),
        "Flush": ({"timeout_ms": None}, {"pages_written": None}),
    },
}

BOOL_FIELDS = {
    ("MatchPrefixRequest", "lock"), ("MatchPrefixRequest", "prefetch"),
    ("InsertRequest", "mamba_checkpoint"), ("InsertRequest", "keep_lock"),
    ("HealthRequest", "deep"), ("BackendHealth", "healthy"),
}
# API.md calls these optional: the daemon must tell "absent" from 0.
OPTIONAL_FIELDS = {
    ("MatchPrefixRequest", "allocate_tokens"),
    ("AllocateRequest", "lock_id"), ("AllocateRequest", "allocation_id"),
}


def _services() -> dict[str, ServiceDescriptor]:
    return {
        "HiCache": hicache_pb2.DESCRIPTOR.services_by_name["HiCache"],
        "Admin": admin_pb2.DESCRIPTOR.services_by_name["Admin"],
    }


def _missing(desc: Descriptor, spec: Spec, where: str) -> Iterator[str]:
    for key, nested in spec.items():
        name = key.removesuffix("[]")
        field = desc.fields_by_name.get(name)
        if field is None:
            yield f"{where}.{name}: missing"
            continue
        if field.is_repeated != key.endswith("[]"):
            yield f"{where}.{name}: repeated={field.is_repeated}, API.md says {key}"
        if nested is not None:
            if field.message_type is None:
                yield f"{where}.{name}: not a message"
            else:
                yield from _missing(field.message_type, nested, f"{where}.{name}")


def _all_messages() -> Iterator[Descriptor]:
    def walk(desc: Descriptor) -> Iterator[Descriptor]:
        yield desc
        for nested in desc.nested_types:
            yield from walk(nested)

    for module in (hicache_pb2, admin_pb2):
        for desc in module.DESCRIPTOR.message_types_by_name.values():
            yield from walk(desc)


def _load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- staleness


def test_generated_code_is_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_check_reports_changed_missing_and_orphan_files() -> None:
    gen = _load_gen_proto()
    wanted: dict[str, str] = gen.generate()
    assert gen.stale(wanted, dict(wanted)) == []

    edited = dict(wanted)
    edited["hicache/v1/hicache_pb2.py"] += "# hand edit\n"
    missing = {k: v for k, v in wanted.items() if k != "hicache/v1/admin_pb2.pyi"}
    orphan = {**wanted, "hicache/v1/old_pb2.py": ""}

    assert [p.split(":")[0] for p in gen.stale(wanted, edited)] == ["differs"]
    assert gen.stale(wanted, missing) == ["missing: hicache/pb/hicache/v1/admin_pb2.pyi"]
    assert gen.stale(wanted, orphan) == [
        "not generated by any .proto: hicache/pb/hicache/v1/old_pb2.py"
    ]


def test_generation_covers_py_grpc_and_pyi_for_every_proto() -> None:
    gen = _load_gen_proto()
    files = set(gen.generate())
    for proto in ("hicache", "admin"):
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert f"hicache/v1/{proto}{suffix}" in files
    assert {"__init__.py", "hicache/__init__.py", "hicache/v1/__init__.py"} <= files


def test_import_rewrite_touches_only_our_packages() -> None:
    gen = _load_gen_proto()
    text = (
        "import grpc\n"
        "from google.protobuf import descriptor as _descriptor\n"
        "from hicache.v1 import hicache_pb2 as hicache_dot_v1_dot_hicache__pb2\n"
    )
    assert gen.rewrite_imports(text, {"hicache.v1"}).splitlines() == [
        "import grpc",
        "from google.protobuf import descriptor as _descriptor",
        "from hicache.pb.hicache.v1 import hicache_pb2 as hicache_dot_v1_dot_hicache__pb2",
    ]
    grpc_module = (ROOT / "hicache/pb/hicache/v1/hicache_pb2_grpc.py").read_text()
    assert "\nfrom hicache.v1 import" not in grpc_module


# --------------------------------------------------------------------------- the contract


def test_package_and_canonical_file_names() -> None:
    assert hicache_pb2.DESCRIPTOR.package == "hicache.v1"
    assert admin_pb2.DESCRIPTOR.package == "hicache.v1"
    assert hicache_pb2.DESCRIPTOR.name == "hicache/v1/hicache.proto"
    assert admin_pb2.DESCRIPTOR.name == "hicache/v1/admin.proto"


def test_every_api_rpc_and_field_exists() -> None:
    services = _services()
    problems: list[str] = []
    for service_name, rpcs in API.items():
        service = services[service_name]
        extra = set(service.methods_by_name) - set(rpcs)
        if extra:
            problems.append(f"{service_name}: RPCs not in API.md: {sorted(extra)}")
        for rpc, (request, response) in rpcs.items():
            method = service.methods_by_name.get(rpc)
            if method is None:
                problems.append(f"{service_name}.{rpc}: missing")
                continue
            problems += _missing(method.input_type, request, f"{rpc}({method.input_type.name})")
            problems += _missing(method.output_type, response, f"{rpc}->{method.output_type.name}")
    assert problems == []


def test_only_load_streams() -> None:
    streaming = {
        (s.name, m.name)
        for s in _services().values()
        for m in s.methods
        if m.client_streaming or m.server_streaming
    }
    assert streaming == {("HiCache", "Load")}
    load = _services()["HiCache"].methods_by_name["Load"]
    assert load.output_type.name == "LoadProgress"
    assert not load.client_streaming


def test_every_tokens_field_is_bytes() -> None:
    tokens_fields = [
        (d.full_name, f.type)
        for d in _all_messages()
        for f in d.fields
        if f.name == "tokens"
    ]
    assert {name for name, _ in tokens_fields} == {
        "hicache.v1.MatchPrefixRequest", "hicache.v1.InsertRequest",
    }
    assert all(t == FieldDescriptor.TYPE_BYTES for _, t in tokens_fields)
    assert not hicache_pb2.MatchPrefixRequest.DESCRIPTOR.fields_by_name["tokens"].is_repeated


def test_page_ids_are_bytes_and_the_old_field_number_is_reserved() -> None:
    """Page ids travel like tokens (one array, little-endian int32); the number of the
    repeated field they replaced is never reused, so an old peer reads nothing rather
    than misreading."""
    message = hicache_pb2.MemberPages.DESCRIPTOR
    field = message.fields_by_name["page_ids"]
    assert field.type == FieldDescriptor.TYPE_BYTES and not field.is_repeated
    assert field.number != 2 and 2 not in message.fields_by_number
    proto = (ROOT / "proto" / "hicache" / "v1" / "hicache.proto").read_text()
    assert "reserved 2;" in proto.split("message MemberPages", 1)[1].split("}", 1)[0]


def test_bool_and_optional_fields() -> None:
    messages = {d.name: d for d in _all_messages()}
    for message, field in BOOL_FIELDS:
        assert messages[message].fields_by_name[field].type == FieldDescriptor.TYPE_BOOL
    for message, field in OPTIONAL_FIELDS:
        assert messages[message].fields_by_name[field].has_presence, (message, field)
    release = hicache_pb2.ReleaseRequest.DESCRIPTOR
    assert [f.name for f in release.oneofs_by_name["target"].fields] == [
        "lock_id", "allocation_id",
    ]


def test_enums() -> None:
    kind = hicache_pb2.Pool.DESCRIPTOR.fields_by_name["kind"].enum_type
    state = hicache_pb2.PrefetchStatusResponse.DESCRIPTOR.fields_by_name["state"].enum_type
    for enum, names in (
        (kind, ["SHM", "CUDA_IPC"]),
        (state, ["RUNNING", "DONE", "CANCELLED", "TIMED_OUT", "FAILED"]),
    ):
        assert enum is not None
        assert enum.values[0].number == 0
        assert enum.values[0].name.endswith("_UNSPECIFIED")
        assert [v.name for v in enum.values[1:]] == names


def test_batch_covers_every_request_except_load() -> None:
    methods = _services()["HiCache"].methods_by_name
    op = hicache_pb2.BatchOp.DESCRIPTOR.oneofs_by_name["op"]
    result = hicache_pb2.BatchResult.DESCRIPTOR.oneofs_by_name["result"]
    batchable = {name for name in methods if name not in ("Load", "Batch")}
    assert {f.message_type.name for f in op.fields} == {
        methods[n].input_type.name for n in batchable
    }
    assert {f.message_type.name for f in result.fields} == {
        methods[n].output_type.name for n in batchable
    } | {"OpStatus"}
    # The same oneof name on both sides, so a server maps an op to its result by name.
    assert {f.name for f in op.fields} == {f.name for f in result.fields} - {"status"}
    status = hicache_pb2.OpStatus.DESCRIPTOR.fields_by_name
    assert status["code"].type == FieldDescriptor.TYPE_INT32
    assert status["message"].type == FieldDescriptor.TYPE_STRING


# --------------------------------------------------------------------------- messages


def _tokens(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def test_batch_round_trip() -> None:
    request = hicache_pb2.BatchRequest(
        ops=[
            hicache_pb2.BatchOp(
                match_prefix=hicache_pb2.MatchPrefixRequest(
                    namespace="tenant-a", tokens=_tokens([1, 2, 3, 70000]), lock=True,
                    allocate_tokens=0,
                )
            ),
            hicache_pb2.BatchOp(allocate=hicache_pb2.AllocateRequest(num_tokens=128, lock_id=7)),
            hicache_pb2.BatchOp(release=hicache_pb2.ReleaseRequest(allocation_id=9)),
            hicache_pb2.BatchOp(stats=hicache_pb2.StatsRequest()),
        ]
    )
    parsed = hicache_pb2.BatchRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert [op.WhichOneof("op") for op in parsed.ops] == [
        "match_prefix", "allocate", "release", "stats",
    ]
    match = parsed.ops[0].match_prefix
    assert np.frombuffer(match.tokens, dtype="<u4").tolist() == [1, 2, 3, 70000]
    # Presence survives the wire even for 0, and absence stays absence.
    assert match.HasField("allocate_tokens") and match.allocate_tokens == 0
    assert parsed.ops[1].allocate.HasField("lock_id")
    assert not parsed.ops[1].allocate.HasField("allocation_id")
    assert parsed.ops[2].release.WhichOneof("target") == "allocation_id"

    response = hicache_pb2.BatchResponse(
        results=[
            hicache_pb2.BatchResult(
                match_prefix=hicache_pb2.MatchPrefixResponse(
                    device_tokens=64, lock_id=5,
                    device_pages=[hicache_pb2.MemberPages(member="full", page_ids=b"\x03\x00\x00\x00")],
                )
            ),
            hicache_pb2.BatchResult(
                status=hicache_pb2.OpStatus(
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="no room",
                )
            ),
        ]
    )
    again = hicache_pb2.BatchResponse.FromString(response.SerializeToString())
    assert again == response
    assert [r.WhichOneof("result") for r in again.results] == ["match_prefix", "status"]
    assert again.results[0].match_prefix.device_pages[0].page_ids == b"\x03\x00\x00\x00"
    assert again.results[1].status.code == 8


class _Cache(hicache_pb2_grpc.HiCacheServicer):
    def Batch(
        self, request: hicache_pb2.BatchRequest, context: grpc.ServicerContext
    ) -> hicache_pb2.BatchResponse:
        results = [
            hicache_pb2.BatchResult(
                status=hicache_pb2.OpStatus(code=5, message=f"no {op.WhichOneof('op')}")
            )
            for op in request.ops
        ]
        return hicache_pb2.BatchResponse(results=results)

    def Load(
        self, request: hicache_pb2.LoadRequest, context: grpc.ServicerContext
    ) -> Iterator[hicache_pb2.LoadProgress]:
        for ready in range(1, 4):
            yield hicache_pb2.LoadProgress(layers_ready=ready, layers_total=3)


class _Admin(admin_pb2_grpc.AdminServicer):
    def Flush(
        self, request: admin_pb2.FlushRequest, context: grpc.ServicerContext
    ) -> admin_pb2.FlushResponse:
        return admin_pb2.FlushResponse(pages_written=request.timeout_ms)


def test_generated_services_serve_over_a_unix_socket(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/hicache.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    hicache_pb2_grpc.add_HiCacheServicer_to_server(_Cache(), server)
    admin_pb2_grpc.add_AdminServicer_to_server(_Admin(), server)
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            cache = hicache_pb2_grpc.HiCacheStub(channel)
            reply = cache.Batch(
                hicache_pb2.BatchRequest(
                    ops=[hicache_pb2.BatchOp(heartbeat=hicache_pb2.HeartbeatRequest())]
                ),
                timeout=10,
            )
            assert reply.results[0].status.message == "no heartbeat"
            progress = [p.layers_ready for p in cache.Load(hicache_pb2.LoadRequest(), timeout=10)]
            assert progress == [1, 2, 3]
            with pytest.raises(grpc.RpcError) as err:
                cache.Stats(hicache_pb2.StatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            flushed = admin_pb2_grpc.AdminStub(channel).Flush(
                admin_pb2.FlushRequest(timeout_ms=42), timeout=10
            )
            assert flushed.pages_written == 42
    finally:
        server.stop(grace=None)
