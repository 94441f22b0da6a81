"""Frame codec: every message kind round-trips, and hostile frames raise WireError only.

Peers are untrusted: every test below that feeds bytes to decode() asserts the exception
type is exactly WireError (never msgpack's, torch's or a ValueError) and, for the
allocation cases, that nothing large was allocated before the frame was refused.
"""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard.arch import ModelConfig
from shard.errors import WireError
from shard.wire import codec
from shard.wire.codec import decode, encode
from shard.wire.dtypes import BY_NAME, FLOAT_NAMES, FP8_NAMES
from shard.wire.fp8 import encode_fp8
from shard.wire.limits import FRAME_PREFIX, MAX_RECEIPTS, Limits
from shard.wire.messages import (REGISTRY, Assignment, AuditRequest, EndJob, Forward, HopPath, JobError, LinkReport, Ping, Pong, ProbePeers, Ready,
                                 Refused, Register, ReleaseFrames, Result)
from shard.wire.weight_messages import (FetchReport, ManifestRequest, SignedManifest, Sources, SourcesRequest, WeightsChunk,
                                        WeightsRefused, WeightsRequest)

H = 8
LIMITS = Limits(hidden_size=H, max_tokens_per_frame=32)


def _activations(n: int, width: int, dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed))
    if dtype in FP8_NAMES:
        return encode_fp8(x, fmt=dtype.removeprefix("f8_"))
    return x.to(BY_NAME[dtype].torch_dtype), None


def _forward(n=3, dtype="f32", *, tokens=False, aux_layers=0, tree=False, seed=0, int_dtype=torch.int64) -> Forward:
    hidden, scale = _activations(n, H, dtype, seed)
    aux, aux_scale = _activations(n, aux_layers * H, dtype, seed + 1) if aux_layers else (None, None)
    return Forward(
        job_id="job-1", epoch=3, round=7, nonce=b"\x00" * 16, phase="verify", ctx_len=10,
        positions=torch.arange(n, dtype=int_dtype) + 4, commit_src=(6, 8), commit_dst=6,
        tree_parents=torch.arange(-1, n - 1, dtype=torch.int32) if tree else None,
        tokens=torch.arange(n, dtype=int_dtype) if tokens else None,
        hidden=None if tokens else hidden, hidden_scale=None if tokens else scale,
        aux=aux, aux_scale=aux_scale, want_aux_layers=(1, 4), receipts=(b"r" * 100, b""),
    )


SMALL = {
    "end_job": EndJob(job_id="j", epoch=1),
    "job_error": JobError(job_id="j", epoch=1, round=2, code="oom", message="out of KV slots ✗", stage="12D3KooW"),
    "register": Register(
        peer_id="12D3KooWA", model="SmolLM2-135M", manifest_digest="ab" * 32, device="cpu", memory_bytes=8 << 30,
        decode_s_per_layer=0.001, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=1.25e6,
        download_bytes_per_s=1e7, rtt_ms={"12D3KooWB": 20.5, "12D3KooWC": 0.0}, listen_addrs=("/ip4/127.0.0.1/tcp/4001",),
        held_epoch=7, held_start=3, held_end=9,
    ),
    "refused": Refused(code="model_mismatch", reason="rejoin with --model smollm2-135m"),
    "assignment": Assignment(
        epoch=2, peer_id="12D3KooWA", role="stage", layer_start=0, layer_end=15, predecessor=None,
        successor="12D3KooWB", model="SmolLM2-135M", manifest_digest="ab" * 32, wire_dtype="bf16", signature=b"s" * 64,
        max_open_jobs=300,
    ),
    "ready": Ready(peer_id="12D3KooWA", epoch=2),
    "ping": Ping(nonce=2**64 - 2**63 - 1, sent_ns=123, payload=b"\x01" * 1000),
    "pong": Pong(nonce=0, sent_ns=0),
    "probe_peers": ProbePeers(peers={"12D3KooWB": ("/ip4/127.0.0.1/tcp/4002",), "12D3KooWC": ()}, bandwidth_bytes=65536),
    "audit_request": AuditRequest(request_id=7, job_id="j", epoch=1, rounds=(2, 2, 3), sides=("input", "output", "input"),
                                   max_bytes=4096),
    "release_frames": ReleaseFrames(job_ids=("j", "job-2"), epochs=(1, 3)),
    "link_report": LinkReport(peer_id="12D3KooWA", rtt_ms={"12D3KooWB": 41.0}, upload_bytes_per_s=2.5e6),
    "hop_path": HopPath(peer_id="12D3KooWA", successor="12D3KooWB", path="relayed"),
}
SMALL.update({  # weights from peers (shard.wire.weight_messages)
    "manifest_request": ManifestRequest(peer_id="12D3KooWA"),
    "signed_manifest": SignedManifest(manifest=b'{"format": 1}', signature=b"s" * 64),
    "sources_request": SourcesRequest(manifest_digest="ab" * 32, layer_start=0, layer_end=2,
                                      files=("layers/00000.safetensors", "embed.safetensors")),
    "sources": Sources(holders={"layers/00000.safetensors": ("12D3KooWB",)}, addrs={"12D3KooWB": ("/ip4/1.2.3.4/tcp/1",)},
                       upload_bytes_per_s={"12D3KooWB": 1e6}),
    "fetch_report": FetchReport(peer_id="12D3KooWA", layer_start=0, layer_end=2, files=3, bytes=10, seconds=0.5,
                                by_source={"12D3KooWB": 10}, excluded={"12D3KooWC": "bad sha256"}),
    "weights_request": WeightsRequest(manifest_digest="ab" * 32, file="layers/00000.safetensors", offset=0, length=9),
    "weights_chunk": WeightsChunk(offset=7, data=b"\x00\xff" * 100),
    "weights_refused": WeightsRefused(code="busy", reason="serving 8 fetchers"),
})


def _same(a, b) -> bool:
    """Field-wise equality; tensors compared bit for bit (NaN-safe, fp8-safe)."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
        elif (tuple(x) if isinstance(x, list) else x) != y:
            return False
    return True


def _frame(header: dict, tail: bytes = b"") -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(head)) + head + tail


def _split(body: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from(">I", body)
    return msgpack.unpackb(body[4 : 4 + n], raw=False), body[4 + n :]


def _refuse(body, limits: Limits = LIMITS) -> WireError:
    with pytest.raises(WireError) as info:
        decode(body, limits)
    assert type(info.value) is WireError
    return info.value


# ---- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(FLOAT_NAMES))
@pytest.mark.parametrize("shape", ["hidden", "hidden+aux+tree", "tokens"])
def test_forward_and_result_round_trip_every_float_dtype(dtype, shape):
    # Bug guarded: a dtype whose bytes or itemsize disagree between encode and decode
    # (bf16 and fp8 have no numpy equivalent). Sound: bitwise comparison of every field.
    msg = _forward(5, dtype, tokens=shape == "tokens", aux_layers=2 if "aux" in shape else 0, tree="tree" in shape)
    assert _same(decode(encode(msg), LIMITS), msg)
    if shape != "tokens":
        res = Result(job_id="j", epoch=1, round=1, hidden=msg.hidden, hidden_scale=msg.hidden_scale,
                     aux=msg.aux, aux_scale=msg.aux_scale, receipts=(b"x",))
        assert _same(decode(bytearray(encode(res)), LIMITS), res)


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_forward_round_trip_int_dtypes(int_dtype):
    msg = _forward(4, tokens=True, int_dtype=int_dtype)
    out = decode(encode(msg), LIMITS)
    assert _same(out, msg) and out.positions.dtype == int_dtype


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_small_messages_round_trip(kind):
    msg = SMALL[kind]
    out = decode(encode(msg), Limits())
    assert out == msg and type(out) is REGISTRY[kind]


def test_registry_covers_every_kind():
    # AuditReply carries a tensor (compared bitwise elsewhere), like forward and result;
    # the verify messages round-trip in tests/shard/test_verifier.py and test_verify_parts.py.
    assert set(REGISTRY) == set(SMALL) | {"forward", "result", "audit_reply", "verify_request", "verify_reply",
                                          "verify_part"}


def test_writable_body_is_viewed_not_copied_and_odd_offsets_are_realigned():
    # Bug guarded: a copy per tensor (zero-copy lost) or an unaligned int64/f32 view.
    body = bytearray(encode(_forward(6, "f32")))
    out = decode(body, LIMITS)
    lo, hi = torch.frombuffer(body, dtype=torch.uint8).data_ptr(), None
    hi = lo + len(body)
    assert lo <= out.hidden.data_ptr() < hi
    shifted = bytearray(1) + body  # every tensor now starts one byte later
    out = decode(memoryview(shifted)[1:], LIMITS)
    for t in (out.hidden, out.positions):
        assert t.data_ptr() % t.element_size() == 0
    assert _same(out, _forward(6, "f32"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 32), dtype=st.sampled_from(sorted(FLOAT_NAMES)), aux=st.integers(0, 3),
       tokens=st.booleans(), seed=st.integers(0, 1000), data=st.data())
def test_forward_round_trip_property(n, dtype, aux, tokens, seed, data):
    parents = data.draw(st.lists(st.integers(-1, n - 1), min_size=n, max_size=n))
    parents = [min(p, i - 1) for i, p in enumerate(parents)]  # -1 <= parent[i] < i
    msg = dataclasses.replace(_forward(n, dtype, tokens=tokens, aux_layers=aux, seed=seed),
                              tree_parents=torch.tensor(parents, dtype=torch.int32))
    assert _same(decode(encode(msg), LIMITS), msg)


# ---- hostile bytes --------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_wire_error_only(blob):
    _refuse(blob)


VALID = [encode(_forward(3, "f8_e4m3fn", aux_layers=1, tree=True)), encode(SMALL["register"]), encode(SMALL["assignment"])]


@pytest.mark.parametrize("body", VALID, ids=["forward", "register", "assignment"])
def test_every_truncation_raises_wire_error(body):
    # Bug guarded: a length check that trusts the declared size (reads past the end,
    # or msgpack's OutOfData escaping). Sound: every prefix is tried.
    for cut in range(len(body)):
        _refuse(body[:cut])


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(VALID) - 1), bit=st.integers(0, 10**9))
def test_bit_flips_decode_or_raise_wire_error(which, bit):
    # A flip inside tensor data is still a valid frame; anywhere else it must be refused
    # with WireError, never another exception.
    body = bytearray(VALID[which])
    body[(bit // 8) % len(body)] ^= 1 << (bit % 8)
    try:
        decode(body, LIMITS)
    except WireError:
        pass


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(VALID) - 1), data=st.data(), junk=JUNK)
def test_any_header_field_replaced_by_junk_decodes_or_raises_wire_error(which, data, junk):
    # Bug guarded: a field validator that lets a wrong type through to code that then
    # crashes with TypeError/AttributeError (e.g. len(None), torch op on a str).
    header, tail = _split(VALID[which])
    key = data.draw(st.sampled_from(sorted(header)))
    header[key] = junk
    try:
        decode(_frame(header, tail), LIMITS)
    except WireError:
        pass


def test_tensor_declaring_2_40_elements_with_empty_body_allocates_nothing(monkeypatch):
    # Bug guarded: allocating from a declared shape before checking it. torch allocations
    # are invisible to tracemalloc, so torch's allocators are made to fail too.
    def boom(*a, **k):
        raise AssertionError("allocated for a refused frame")

    monkeypatch.setattr(torch, "frombuffer", boom)
    monkeypatch.setattr(torch, "empty", boom)
    header, _ = _split(encode(_forward(2)))
    header["tensors"] = [["positions", "i64", [2], 16], ["hidden", "f32", [1 << 20, 1 << 20], 4 << 40]]
    body = _frame(header)
    tracemalloc.start()
    err = _refuse(body)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert str(err) == "tensor elements (limit 67108864, got 1099511627778)"
    assert peak < 256 * 1024


def _header_case(mutate, base=None) -> bytes:
    """A valid forward frame with its header edited by `mutate` (which may return a new tail)."""
    header, tail = _split(base or encode(_forward(2)))
    new_tail = mutate(header)
    return _frame(header, new_tail if isinstance(new_tail, bytes) else tail)


PINNED = {
    # Every kind is named, sorted: derived from the registry, which grows with the protocol.
    "unknown kind": (lambda h: h.update(kind="Pickle"), f"message kind (limit {sorted(REGISTRY)}, got Pickle)"),
    "bool version": (lambda h: h.update(v=True), "protocol version (limit 4, got True)"),
    "old version": (lambda h: h.update(v=3), "protocol version (limit 4, got 3)"),
    "future version": (lambda h: h.update(v=5), "protocol version (limit 4, got 5)"),
    "trailer field in header": (lambda h: h.update(receipts=[]), "unknown field for 'forward' (limit None, got receipts)"),
    "bool for int": (lambda h: h.update(epoch=True), "field 'epoch' type (limit int, got bool)"),
    "negative int": (lambda h: h.update(round=-1), "field 'round' range (limit [0, 9223372036854775807], got -1)"),
    "long job id": (lambda h: h.update(job_id="j" * 65), "field 'job_id' length (limit 64, got 65)"),
    # Job ids and nonces follow the receipt schema (receipts.schema), which a stage's
    # signer enforces: a frame that passed decode with a 3-byte nonce killed the node there.
    "empty job id": (lambda h: h.update(job_id=""), "field 'job_id' value (limit 1..64 chars of [A-Za-z0-9._-] starting alphanumeric, got )"),
    "job id outside the alphabet": (lambda h: h.update(job_id="../etc"), "field 'job_id' value (limit 1..64 chars of [A-Za-z0-9._-] starting alphanumeric, got ../etc)"),
    "short nonce": (lambda h: h.update(nonce=b"abc"), "field 'nonce' length (limit 16..32, got 3)"),
    "long nonce": (lambda h: h.update(nonce=b"n" * 33), "field 'nonce' length (limit 16..32, got 33)"),
    "bad phase": (lambda h: h.update(phase="train"), "field 'phase' value (limit ['prefill', 'decode', 'verify'], got train)"),
    "str for bytes": (lambda h: h.update(nonce="abc"), "field 'nonce' type (limit bytes, got str)"),
    "bool in list": (lambda h: h.update(commit_src=[1, True]), "field 'commit_src'[1] type (limit int, got bool)"),
    "missing field": (lambda h: h.pop("ctx_len"), "field 'ctx_len' missing"),
    "unknown field": (lambda h: h.update(__class__="x"), "unknown field for 'forward' (limit None, got __class__)"),
    "unknown dtype": (lambda h: h["tensors"][0].__setitem__(1, "f64"), "tensor 'positions' dtype (limit ['f32', 'f16', 'bf16', 'f8_e4m3fn', 'f8_e5m2', 'i64', 'i32', 'u8', 'bool'], got f64)"),
    "dtype not for field": (lambda h: h["tensors"][0].__setitem__(1, "f32"), "tensor 'positions' dtype (limit ['i32', 'i64'], got f32)"),
    "negative dim": (lambda h: h["tensors"][0].__setitem__(2, [-2]), "tensor 'positions' dim (limit [0, 67108864], got -2)"),
    "rank 5": (lambda h: h["tensors"][0].__setitem__(2, [1, 1, 1, 1, 2]), "tensor 'positions' rank (limit 4, got 5)"),
    "nbytes lies": (lambda h: h["tensors"][0].__setitem__(3, 8), "tensor 'positions' nbytes (limit 16, got 8)"),
    "name not a field": (lambda h: h["tensors"][0].__setitem__(0, "__init__"), "tensor entry 0 name (limit ['aux', 'aux_scale', 'hidden', 'hidden_scale', 'positions', 'tokens', 'tree_parents'], got __init__)"),
    "repeated tensor": (lambda h: h["tensors"].append(list(h["tensors"][0])), "tensor 'positions' repeated"),
    # _forward(2): hidden f32 (2, 8) = 64 bytes stays; positions' 16 bytes go.
    "missing tensor": (lambda h: h.__setitem__("tensors", [e for e in h["tensors"] if e[0] != "positions"]) or b"\x00" * 64, "tensor 'positions' missing"),
    "long pad": (lambda h: h.update(pad=b"\x00" * 8), "field 'pad' length (limit 7, got 8)"),
    "deep nesting": (lambda h: h.update(commit_src=[[[[[[[[1]]]]]]]]), "header nesting depth (limit 8, got 9)"),
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_adversarial_headers_raise_pinned_errors(case):
    mutate, text = PINNED[case]
    assert str(_refuse(_header_case(mutate))) == text


def test_framing_errors_pinned():
    body = encode(_forward(2))
    assert str(_refuse(body, Limits(max_frame_bytes=64, max_header_bytes=64))) == f"frame length (limit 64, got {len(body)})"
    assert str(_refuse(b"\x00\x00\x00\x00")).startswith("header msgpack (limit None, got ")
    assert str(_refuse(struct.pack(">I", 3 << 20) + b"x")) == "header length (limit 2097152, got 3145728)"
    assert str(_refuse(body[:-1])).startswith("trailer msgpack (limit None, got ")
    assert str(_refuse(body + b"\x00")).startswith("trailer msgpack (limit None, got ExtraData")
    tensors_end = len(codec.encode_body(_forward(2)))
    assert str(_refuse(body[: tensors_end - 1])) == "tensor bytes after header (limit 80, got 79)"  # declared, present
    assert str(_refuse(encode(SMALL["end_job"]) + b"\x00")) == "bytes after the tensors (limit 0, got 1)"
    assert str(_refuse(_frame([1, 2]))) == "header type (limit map, got list)"
    assert str(_refuse(_frame({"v": 4, "kind": "ping"}) + b"")).startswith("field 'nonce' missing")
    ext = msgpack.packb({"v": 1, "x": msgpack.ExtType(5, b"abc")})
    assert str(_refuse(struct.pack(">I", len(ext)) + ext)).startswith("header msgpack (limit None, got ValueError")
    extra = msgpack.packb({"v": 1}) + b"\xc0"
    assert str(_refuse(struct.pack(">I", len(extra)) + extra)).startswith("header msgpack (limit None, got ExtraData")
    assert str(_refuse("text")) == "frame body type (limit bytes, got str)"


# ---- trailer: what each stage appends, outside the canonical bytes ---------------------


def _with_trailer(msg, trailer) -> bytes:
    return codec.encode_body(msg) + msgpack.packb(trailer, use_bin_type=True)


def test_canonical_bytes_are_the_prefix_before_the_trailer():
    # Bug guarded: receipts hashing bytes that change as stages append their receipts
    # (the chain would break at every hop), or a receiver that cannot find the prefix.
    f = _forward(3, aux_layers=2)
    body = encode(f)
    decoded, n = codec.decode_frame(body, LIMITS)
    assert body[:n] == codec.encode_body(f) and _same(decoded, f)
    more = dataclasses.replace(f, receipts=(*f.receipts, b"s" * 300), compute_s=(0.5, 0.25))
    assert codec.encode_body(more) == codec.encode_body(f) and encode(more) != body
    assert codec.decode_frame(encode(more), LIMITS)[1] == n
    # The logged canonical bytes decode on their own, trailer fields empty.
    alone = decode(codec.encode_body(f), LIMITS, canonical=True)
    assert alone.receipts == () and alone.compute_s == () and _same(dataclasses.replace(alone, receipts=f.receipts), f)
    with pytest.raises(WireError, match="bytes after the tensors"):
        decode(body, LIMITS, canonical=True)


def test_trailer_errors_pinned():
    f = _forward(2)
    assert str(_refuse(codec.encode_body(f))).startswith("trailer msgpack (limit None, got ")  # cut before the trailer
    assert str(_refuse(_with_trailer(f, {"receipts": []}))) == "trailer field 'compute_s' missing"
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": []}))) == "trailer field 'clock_s' missing"
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": [], "clock_s": []}))) == "trailer field 'burst' missing"
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": [], "clock_s": [], "burst": [], "x": 1}))) == (
        "unknown trailer field for 'forward' (limit ['receipts', 'compute_s', 'clock_s', 'burst'], got x)")
    assert str(_refuse(_with_trailer(f, {"receipts": [1], "compute_s": [], "clock_s": []}))) == (
        "field 'receipts'[0] type (limit bytes, got int)")
    assert str(_refuse(_with_trailer(f, [1]))) == "trailer type (limit map, got list)"
    assert str(_refuse(_with_trailer(f, {"receipts": [[[[[[[[[]]]]]]]]], "compute_s": [], "clock_s": []}))) == (
        "trailer nesting depth (limit 8, got 9)")


def test_clock_times_ride_the_trailer_bounded():
    # Bug guarded: per-hop transfer times built from stage clocks a peer can make unbounded
    # (a list the size of the frame) or non-finite (NaN medians on the status page). Two
    # stamps per stage, at most 2 * MAX_RECEIPTS, finite and >= 0, outside the signed bytes.
    f = _forward(2)
    stamped = dataclasses.replace(f, clock_s=(1.7e9, 1.7e9 + 0.25))
    assert codec.encode_body(stamped) == codec.encode_body(f)
    assert codec.decode_frame(encode(stamped), LIMITS)[0].clock_s == (1.7e9, 1.7e9 + 0.25)
    cap = 2 * MAX_RECEIPTS
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": [], "clock_s": [1.0] * (cap + 1)}))) == (
        f"field 'clock_s' length (limit {cap}, got {cap + 1})")
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": [], "clock_s": [float("nan")]}))) == (
        "field 'clock_s'[0] range (limit finite >= 0.0, got nan)")
    assert str(_refuse(_with_trailer(f, {"receipts": [], "compute_s": [], "clock_s": [-1.0]}))) == (
        "field 'clock_s'[0] range (limit finite >= 0.0, got -1.0)")


def test_huge_nesting_and_long_lists_are_refused_by_the_parser():
    deep = b"\x91" * 5000 + b"\xc0"  # 5000 nested one-element arrays
    _refuse(struct.pack(">I", len(deep)) + deep)
    header, tail = _split(encode(_forward(2)))
    header["commit_src"] = list(range(5000))
    assert str(_refuse(_frame(header, tail))).startswith("header msgpack (limit None, got ValueError: 5000 exceeds max_array_len(4096)")


# ---- per-message shape rules ----------------------------------------------------------


def _shape_error(msg, limits: Limits = LIMITS) -> str:
    """The decode error for a frame carrying `msg`, which encode() itself would refuse."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(msg), "check", lambda self, limits: None)
        body = encode(msg, Limits())
    return str(_refuse(body, limits))


def test_forward_shape_rules():
    f = _forward(3)
    assert _shape_error(f, dataclasses.replace(LIMITS, hidden_size=9)) == "tensor 'hidden' shape (limit [3, 9], got [3, 8])"
    assert _shape_error(f, dataclasses.replace(LIMITS, max_tokens_per_frame=2)) == "tensor 'positions' tokens (limit 2, got 3)"
    assert _shape_error(dataclasses.replace(f, tokens=torch.arange(3))) == "exactly one of tensors 'tokens', 'hidden' (limit 1, got 2)"
    assert _shape_error(dataclasses.replace(f, positions=torch.tensor([0, -1, 2]))) == "tensor 'positions' values (limit >= 0, got -1)"
    bad_tree = dataclasses.replace(f, tree_parents=torch.tensor([-1, 1, 0], dtype=torch.int32))
    assert _shape_error(bad_tree) == "tensor 'tree_parents'[1] value (limit [-1, 1), got 1)"
    assert _shape_error(dataclasses.replace(f, tree_parents=torch.tensor([-2, 0, 0], dtype=torch.int32))) == "tensor 'tree_parents'[0] value (limit [-1, 0), got -2)"
    assert _shape_error(dataclasses.replace(f, aux=torch.zeros(3, 12))) == "tensor 'aux' shape (limit [3, 'k*8'], got [3, 12])"
    assert _shape_error(dataclasses.replace(f, ctx_len=7)) == "field 'commit_dst' + len(commit_src) vs 'ctx_len' (limit 7, got 8)"
    fp8 = _forward(3, "f8_e4m3fn")
    assert _shape_error(dataclasses.replace(fp8, hidden_scale=None)) == "tensor 'hidden_scale' missing for fp8 'hidden'"
    assert _shape_error(dataclasses.replace(f, hidden_scale=torch.ones(3))) == "tensor 'hidden_scale' with non-fp8 'hidden'"
    assert _shape_error(dataclasses.replace(fp8, hidden_scale=torch.ones(2))) == "tensor 'hidden_scale' shape (limit [3], got [2])"


def test_encode_refuses_what_decode_would_refuse():
    # Bug guarded: a sender shipping frames its peers must drop (caught at the source).
    with pytest.raises(WireError, match="exactly one of"):
        encode(dataclasses.replace(_forward(2), tokens=torch.arange(2)))
    with pytest.raises(WireError, match="field 'epoch' type"):
        encode(EndJob(job_id="j", epoch=True))
    with pytest.raises(WireError, match="tensor 'hidden' dtype"):
        encode(dataclasses.replace(_forward(2), hidden=torch.zeros(2, H, dtype=torch.float64)))
    with pytest.raises(WireError, match="layer_end"):
        encode(dataclasses.replace(SMALL["assignment"], layer_end=0))
    with pytest.raises(WireError, match="layer_end"):  # a stage with no layers
        encode(dataclasses.replace(SMALL["assignment"], layer_start=3, layer_end=3))
    # Off-ring roles may name no slice at all; a stage may not.
    empty = dataclasses.replace(SMALL["assignment"], role="relay", layer_start=3, layer_end=3)
    assert decode(encode(empty), Limits()) == empty
    with pytest.raises(TypeError):
        encode({"kind": "ping"})


def test_bool_tensor_bytes_must_be_0_or_1():
    # No message carries bool tensors yet; the view builder still refuses bytes torch
    # would treat as undefined booleans.
    body = bytearray(b"\x00\x01\x02")
    with pytest.raises(WireError, match="tensor 'mask' values"):
        codec._tensor_views(body, memoryview(body), 0, {"mask": ("bool", [3], 3)})


# ---- signing bytes, limits -------------------------------------------------------------


def test_assignment_signing_bytes_cover_every_field_but_signature():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    a = SMALL["assignment"]
    key = Ed25519PrivateKey.generate()
    signed = dataclasses.replace(a, signature=key.sign(a.signing_bytes()))
    received = decode(encode(signed), Limits())
    key.public_key().verify(received.signature, received.signing_bytes())  # raises if not
    assert dataclasses.replace(a, signature=b"other").signing_bytes() == a.signing_bytes()
    changes = dict(epoch=3, peer_id="other", role="verifier", layer_start=1, layer_end=16, predecessor="p",
                   successor=None, successor_addrs=("/ip4/127.0.0.1/tcp/1",), relay_addrs=("/ip4/10.0.0.1/tcp/2",), relay_for=("q",), model="other", manifest_digest="cd" * 32,
                   wire_dtype="f8_e4m3fn", aux_dtype="f8_e4m3fn", max_open_jobs=512)
    assert set(changes) == {f.name for f in dataclasses.fields(a)} - {"signature"}
    for name, value in changes.items():
        assert dataclasses.replace(a, **{name: value}).signing_bytes() != a.signing_bytes(), name


def _model_limits() -> Limits:
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=H, intermediate_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=4, vocab_size=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                      tie_word_embeddings=True, qkv_bias=False)
    return Limits.for_model(cfg, max_tokens_per_frame=32)


def test_positions_context_and_layers_are_bounded_by_the_model():
    # Bug guarded: a Forward whose positions held 2^40 decoded, then the stage's rotary
    # table tried to grow to 2^40 rows (4.4 TB) and the node died. The model's context
    # (128 here) bounds positions and ctx_len, its layer count the aux layers asked for.
    limits = _model_limits()
    ok = dataclasses.replace(_forward(2), want_aux_layers=(0, 1))
    assert _same(decode(encode(ok), limits), ok)
    far = dataclasses.replace(ok, positions=torch.tensor([5, 1 << 40]))
    assert str(_refuse(encode(far), limits)) == "tensor 'positions' values (limit < 128 (the model's context), got 1099511627776)"
    edge = dataclasses.replace(ok, positions=torch.tensor([126, 128]))
    assert str(_refuse(encode(edge), limits)) == "tensor 'positions' values (limit < 128 (the model's context), got 128)"
    ctx = dataclasses.replace(ok, ctx_len=129)
    assert str(_refuse(encode(ctx), limits)) == "field 'ctx_len' (limit <= 128 (the model's context), got 129)"
    layers = dataclasses.replace(ok, want_aux_layers=(1, 2))
    assert str(_refuse(encode(layers), limits)) == "field 'want_aux_layers' values (limit < 2 (the model's layers), got 2)"
    slice_past = dataclasses.replace(SMALL["assignment"], layer_start=1, layer_end=3)
    assert str(_refuse(encode(slice_past), limits)) == "field 'layer_end' (limit <= 2 (the model's layers), got 3)"


def test_assignment_open_jobs_cap_round_trips_within_its_range():
    # Bug guarded: the open-jobs cap a coordinator sends sizes what a stage lets jobs hold
    # (issue 20); a negative, absurd or non-int cap must cost the message at decode with
    # the range named, never reach the worker. 0 (none named) and the limit itself decode.
    from shard.wire.limits import MAX_OPEN_JOBS

    for cap in (0, 1, 300, MAX_OPEN_JOBS):
        a = dataclasses.replace(SMALL["assignment"], max_open_jobs=cap)
        assert decode(encode(a), LIMITS) == a
    header, tail = _split(encode(SMALL["assignment"]))
    for junk, want in ((MAX_OPEN_JOBS + 1, f"field 'max_open_jobs' range (limit [0, {MAX_OPEN_JOBS}], got 65537)"),
                       (-1, f"field 'max_open_jobs' range (limit [0, {MAX_OPEN_JOBS}], got -1)"),
                       (2**63, None), ("128", "field 'max_open_jobs' type (limit int, got str)"),
                       (True, None)):
        err = str(_refuse(_frame({**header, "max_open_jobs": junk}, tail)))
        assert "\n" not in err and (err == want if want else "max_open_jobs" in err), (junk, err)
    with pytest.raises(WireError, match="max_open_jobs"):
        encode(dataclasses.replace(SMALL["assignment"], max_open_jobs=MAX_OPEN_JOBS + 1))


def test_a_refused_frame_names_its_job_when_it_can():
    # A receiver answers a bad frame with a JobError only if it knows which job it was:
    # the decoder says so when job_id, epoch and round were valid, and only then.
    limits = _model_limits()
    ok = dataclasses.replace(_forward(2), want_aux_layers=(0, 1))
    far = _refuse(encode(dataclasses.replace(ok, positions=torch.tensor([5, 1 << 40]))), limits)
    assert far.job == ("job-1", 3, 7)
    bad_nonce = _refuse(_header_case(lambda h: h.update(nonce=b"abc"), encode(ok)), limits)
    assert bad_nonce.job == ("job-1", 3, 7)
    bad_id = _refuse(_header_case(lambda h: h.update(job_id="a b"), encode(ok)), limits)
    assert bad_id.job is None
    assert _refuse(b"\x00" * 40).job is None



def test_frame_job_names_the_job_a_failed_decode_should_answer():
    # A node whose decode fails for a reason of its own (a bug, not the frame) still answers
    # the job the header names (shard.node): frame_job must name it exactly when decode()
    # would have (every one of job_id, epoch, round valid), and never raise on any bytes.
    limits = _model_limits()
    ok = encode(dataclasses.replace(_forward(2), want_aux_layers=(0, 1)))
    assert codec.frame_job(ok, limits) == ("job-1", 3, 7)
    header_end = codec.HEADER_PREFIX.size + codec.HEADER_PREFIX.unpack_from(ok)[0]
    assert header_end < len(ok) and codec.frame_job(ok[:header_end], limits) == ("job-1", 3, 7)  # tensors unread
    assert codec.frame_job(_header_case(lambda h: h.update(job_id="a b"), ok), limits) is None
    assert codec.frame_job(_header_case(lambda h: h.update(round=-1), ok), limits) is None
    for junk in (b"", b"\x00" * 3, b"\xff" * 40, ok[:6], encode(Ready(peer_id="p", epoch=1))):
        assert codec.frame_job(junk, limits) is None

def test_limits_for_model_admit_the_largest_legal_forward():
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=8, vocab_size=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                      tie_word_embeddings=True, qkv_bias=False)
    limits = Limits.for_model(cfg, max_tokens_per_frame=8, max_aux_layers=3)
    n = 8
    msg = dataclasses.replace(_forward(n), hidden=torch.randn(n, 16), aux=torch.randn(n, 48),
                              tree_parents=torch.full((n,), -1, dtype=torch.int32), want_aux_layers=(0, 1))
    body = encode(msg, limits)
    assert len(body) <= limits.max_frame_bytes and FRAME_PREFIX.size == 4
    assert _same(decode(body, limits), msg)
    bigger = dataclasses.replace(msg, aux=torch.randn(n, 64))
    assert "tensor elements" in str(_refuse(encode(bigger, Limits()), limits))
    with pytest.raises(ValueError):
        Limits(max_frame_bytes=1 << 32)


def test_pong_clock_is_optional_finite_and_bounded():
    # Bug guarded: a node's Pong clock feeds every hop time through the coordinator's
    # clock-offset estimate, so a NaN, negative or absurd clock must cost that Pong, not
    # poison the medians; a Pong without one (a node predating the field) still decodes.
    stamped = Pong(nonce=3, sent_ns=5, clock_s=1.7e9 + 0.125)
    assert decode(encode(stamped), LIMITS) == stamped
    assert decode(encode(Pong(nonce=3, sent_ns=5)), LIMITS).clock_s is None
    header, tail = _split(encode(stamped))
    for junk, want in ((float("nan"), "range (limit finite >= 0.0, got nan)"),
                       (float("inf"), "range (limit finite >= 0.0, got inf)"),
                       (-1.0, "range (limit finite >= 0.0, got -1.0)"),
                       ("now", "type (limit float, got str)"),
                       (2e11, "(limit <= 100000000000 (Unix seconds), got 200000000000.0)")):
        assert str(_refuse(_frame({**header, "clock_s": junk}, tail))).endswith(want), junk


def test_a_burst_rides_the_trailer_bounded():
    # Bug guarded: a peer's burst making a stage wait for frames it declared without bound
    # (a size past any forward) or crash on a malformed one; a burst inside the signed
    # bytes (an auditor's replay, which carries none, would then differ). [] or [id, size].
    from shard.wire.trailer import MAX_BURST_FRAMES
    f = _forward(2)
    stamped = dataclasses.replace(f, burst=(41, 3))
    assert codec.encode_body(stamped) == codec.encode_body(f)
    assert codec.decode_frame(encode(stamped), LIMITS)[0].burst == (41, 3)
    assert codec.decode_frame(encode(f), LIMITS)[0].burst == ()
    base = {"receipts": [], "compute_s": [], "clock_s": []}
    for burst, error in (([1], "field 'burst' length (limit 0 or 2 ([id, size]), got 1)"),
                         ([1, 2, 3], "field 'burst' length (limit 0 or 2 ([id, size]), got 3)"),
                         ([1, 0], "field 'burst'[1] (size) range (limit [1, 1024], got 0)"),
                         ([1, MAX_BURST_FRAMES + 1], f"field 'burst'[1] (size) range (limit [1, 1024], got {MAX_BURST_FRAMES + 1})"),
                         ([1 << 32, 2], f"field 'burst'[0] (id) range (limit [0, {(1 << 32) - 1}], got {1 << 32})"),
                         ([-1, 2], f"field 'burst'[0] (id) range (limit [0, {(1 << 32) - 1}], got -1)"),
                         ([True, 2], "field 'burst'[0] (id) type (limit int, got bool)"),
                         ({"a": 1}, "field 'burst' type (limit list, got dict)")):
        assert str(_refuse(_with_trailer(f, {**base, "burst": burst}))) == error
    with pytest.raises(WireError, match="burst"):
        encode(dataclasses.replace(f, burst=(1, 0)))  # we never send what a peer must refuse
