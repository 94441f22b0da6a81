"""The model store's manifest: schema, validation, digests, and the expected tensor layout.

A manifest names every file of a prepared store with its sha256, size and tensors, and
carries the model's config. Its `digest` identifies the model (weights + config) and is
what receipts refer to. Pure: knows no torch, no file reading, no source formats.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from shard.arch import ModelConfig
from shard.errors import StoreError
from shard.layers import LayerRange

FORMAT = 1
MANIFEST_NAME = "manifest.json"
EMBED_FILE = "embed.safetensors"
HEAD_FILE = "head.safetensors"
TOKENIZER_DIR = "tokenizer"
EMBED_TENSOR = "model.embed_tokens.weight"
NORM_TENSOR = "model.norm.weight"
LM_HEAD_TENSOR = "lm_head.weight"
# Float dtypes a store may hold, in safetensors' own names (what safe_open reports).
STORE_DTYPES = ("F32", "F16", "BF16")
# A matmul weight `X.weight` kept quantised is stored as X.weight<suffix> tensors, per kind
# (the layout: shard.quant_weights). The one table of these names; the first holds the values.
QUANT_PARTS = {"int8": (".int8", ".scales"), "int4": (".int4", ".scales", ".zeros")}


# MoE checkpoint naming per layout: the block's prefix and each expert's (gate, up, down)
# projection names; the router is `{prefix}gate.weight`. shard.layer_weights reads these.
MOE_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")), "qwen_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}


def is_quant_part(name: str) -> bool:
    """Whether a store tensor is part of a quantised weight (kept in its own dtype at load)."""
    return any(name.endswith(suffix) for parts in QUANT_PARTS.values() for suffix in parts)


def quant_scheme_name(kind: str, group_size: int) -> str:
    """The shard.quant.SCHEMES name of a grid: "int8" (per channel), "int4" (groups of 32), "int4-g64"..."""
    return kind if kind == "int8" or group_size == 32 else f"{kind}-g{group_size}"


def store_quant(files: dict[str, "FileEntry"]) -> str:
    """The scheme a store's matmuls are kept in, read from its tensor entries: the 4-bit one
    when any weight is int4 (int8 weights beside it stay int8), else "int8" when any is,
    else "none". StoreError for int4 weights with different group sizes."""
    groups, int8 = set(), False
    for f in files.values():
        for name, t in f.tensors.items():
            if name.endswith(QUANT_PARTS["int8"][0]):
                int8 = True
            elif name.endswith(QUANT_PARTS["int4"][0]):
                scales = f.tensors.get(name[: -len(QUANT_PARTS["int4"][0])] + QUANT_PARTS["int4"][1])
                if scales is None or len(t.shape) != 2 or len(scales.shape) != 2 or not scales.shape[1]:
                    raise StoreError(f"int4 weight {name} has no (N, K/G) scales beside it")
                groups.add(2 * t.shape[1] // scales.shape[1])
    if len(groups) > 1:
        raise StoreError(f"int4 weights with different group sizes {sorted(groups)}: one per store")
    if groups:
        return quant_scheme_name("int4", groups.pop())
    return "int8" if int8 else "none"


def layer_file(layer: int) -> str:
    return f"layers/{layer:05d}.safetensors"


def slice_files(r: LayerRange) -> tuple[str, ...]:
    """The weight files a stage serving layers `r` loads: its layers' files, and the
    embedding when it is the head (layer 0; shard.node loads it there)."""
    return tuple(layer_file(i) for i in r) + ((EMBED_FILE,) if r.start == 0 else ())


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Short tensor name -> shape for decoder layer `layer`, in the family's checkpoint naming
    (HF Llama naming, Phi-3's fused projections, Mixtral's or Qwen's experts); an MoE layer
    lists every expert. shard.layer_weights reads the same names."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layout = cfg.family.layout
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
    }
    if layout == "phi3":
        shapes["self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
    else:
        shapes.update({"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h)})
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if cfg.sandwich_norms:
        shapes.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if cfg.is_moe_layer(layer):
        shapes.update(_moe_shapes(cfg))
    elif layout == "phi3":
        shapes.update({"mlp.gate_up_proj.weight": (2 * i, h), "mlp.down_proj.weight": (h, i)})
    else:
        shapes.update(_gated_mlp_shapes("mlp.", ("gate_proj", "up_proj", "down_proj"), h, i))
    return shapes


def _gated_mlp_shapes(prefix: str, names: tuple[str, str, str], h: int, i: int) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    return {f"{prefix}{gate}.weight": (i, h), f"{prefix}{up}.weight": (i, h), f"{prefix}{down}.weight": (h, i)}


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, e = cfg.hidden_size, cfg.num_experts
    prefix, names = MOE_NAMES[cfg.family.layout]
    shapes = {f"{prefix}gate.weight": (e, h)}
    for x in range(e):
        shapes.update(_gated_mlp_shapes(f"{prefix}experts.{x}.", names, h, cfg.expert_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        shapes.update(_gated_mlp_shapes(f"{prefix}shared_expert.", ("gate_proj", "up_proj", "down_proj"), h,
                                        cfg.shared_expert_intermediate_size))
        shapes[f"{prefix}shared_expert_gate.weight"] = (1, h)
    return shapes


def embed_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {EMBED_TENSOR: (cfg.vocab_size, cfg.hidden_size)}


def head_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Final norm, plus the LM head unless it is tied to the embedding."""
    shapes = {NORM_TENSOR: (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD_TENSOR] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding digests are taken over: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "F32"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int
    tensors: dict[str, TensorEntry]  # full tensor name -> entry; empty for tokenizer files

    def to_dict(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "bytes": self.bytes,
            "tensors": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in sorted(self.tensors.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FileEntry":
        tensors = {n: TensorEntry(tuple(int(s) for s in t["shape"]), str(t["dtype"])) for n, t in d["tensors"].items()}
        return cls(sha256=str(d["sha256"]), bytes=int(d["bytes"]), tensors=tensors)


def is_weight_file(relpath: str) -> bool:
    # The tokenizer's serialisation varies with library versions, so two nodes preparing
    # the same model could disagree on its bytes; the model digest covers weights only.
    return not relpath.startswith(TOKENIZER_DIR + "/")


def model_digest(config: dict[str, Any], files: dict[str, FileEntry]) -> str:
    """sha256 over the canonical JSON of the HF config and every weight file's sha256."""
    weights = {rel: f.sha256 for rel, f in files.items() if is_weight_file(rel)}
    return hashlib.sha256(canonical_json({"format": FORMAT, "config": config, "files": weights})).hexdigest()


@dataclass(frozen=True)
class Manifest:
    name: str
    source: str
    model_type: str
    num_layers: int
    config: dict[str, Any]  # the HF config dict, as in config.json
    arch: ModelConfig
    dtype: str  # safetensors dtype name of the layer weights
    files: dict[str, FileEntry]
    layer_bytes: tuple[int, ...]  # file bytes of each layer, index = layer (quantised ones: as kept)
    digest: str
    quant: str = "none"  # the scheme the matmuls are kept in (store_quant of the files; shard.quant_weights)

    @classmethod
    def build(cls, *, name: str, source: str, config: dict[str, Any], dtype: str, files: dict[str, FileEntry]) -> "Manifest":
        arch = ModelConfig.from_hf(config)
        layer_bytes = tuple(files[layer_file(i)].bytes for i in range(arch.num_layers))
        return cls(name, source, arch.model_type, arch.num_layers, config, arch, dtype, dict(sorted(files.items())),
                   layer_bytes, model_digest(config, files), store_quant(files))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "source": self.source,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "config": self.config,
            "arch": self.arch.to_dict(),
            "dtype": self.dtype,
            "files": {rel: f.to_dict() for rel, f in self.files.items()},
            "layer_bytes": list(self.layer_bytes),
            "digest": self.digest,
            "quant": self.quant,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and cross-check a manifest; every inconsistency is a StoreError naming `where`."""
        if d.get("format") != FORMAT:
            raise StoreError(f"{where}: unsupported manifest format {d.get('format')!r} (expected {FORMAT})")
        try:
            files = {str(rel): FileEntry.from_dict(f) for rel, f in d["files"].items()}
            config = d["config"]
            arch = ModelConfig.from_dict(d["arch"])
            m = cls(str(d["name"]), str(d["source"]), str(d["model_type"]), int(d["num_layers"]), config, arch,
                    str(d["dtype"]), files, tuple(int(b) for b in d["layer_bytes"]), str(d["digest"]),
                    str(d.get("quant", "none")))  # stores prepared before quantised ones existed: none
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e
        m.check(where)
        return m

    def check(self, where: str = MANIFEST_NAME) -> None:
        """The fields must agree with each other: the config re-derives the arch, the layer
        count and files line up, and the digest recomputes from the file hashes."""
        if ModelConfig.from_hf(self.config) != self.arch:
            raise StoreError(f"{where}: arch does not match what the config says")
        if self.num_layers != self.arch.num_layers or self.model_type != self.arch.model_type:
            raise StoreError(f"{where}: num_layers/model_type disagree with the config")
        if self.dtype not in STORE_DTYPES:
            raise StoreError(f"{where}: store dtype {self.dtype!r} is not one of {STORE_DTYPES}")
        needed = [layer_file(i) for i in range(self.num_layers)] + [EMBED_FILE, HEAD_FILE]
        missing = [rel for rel in needed if rel not in self.files]
        if missing:
            raise StoreError(f"{where}: lists no entry for {missing[0]}")
        if self.layer_bytes != tuple(self.files[layer_file(i)].bytes for i in range(self.num_layers)):
            raise StoreError(f"{where}: layer_bytes disagree with the file sizes")
        if self.quant != store_quant(self.files):
            raise StoreError(f"{where}: quant {self.quant!r} disagrees with the tensors ({store_quant(self.files)!r})")
        digest = model_digest(self.config, self.files)
        if digest != self.digest:
            raise StoreError(f"{where}: digest {self.digest[:16]}… does not recompute (got {digest[:16]}…)")

    def weights_digest(self, r: LayerRange) -> str:
        """Digest of one slice: the model digest, the range, and its layer files' sha256s."""
        if r.end > self.num_layers:
            raise StoreError(f"layer range {r} is outside the model's {self.num_layers} layers")
        body = {"model": self.digest, "range": [r.start, r.end], "files": [self.files[layer_file(i)].sha256 for i in r]}
        return hashlib.sha256(canonical_json(body)).hexdigest()
