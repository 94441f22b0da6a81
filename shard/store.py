"""The layer-addressable model store on disk: open it, load one slice, or prepare it.

A store dir holds one safetensors file per decoder layer, the embedding, the head, the
tokenizer and a manifest (shard.manifest). A node loads only its slice: it reads, hashes
and maps only those layers' files. This module does not know how to run the layers,
which slice a node should hold, or how to read source formats (shard.sources).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shard.arch import ModelConfig
from shard.errors import DigestMismatchError, StoreError, UnsupportedModelError
from shard.layers import LayerRange
from shard.manifest import (
    EMBED_FILE, EMBED_TENSOR, HEAD_FILE, LM_HEAD_TENSOR, MANIFEST_NAME, NORM_TENSOR, TOKENIZER_DIR,
    FileEntry, Manifest, TensorEntry, embed_tensor_shapes, head_tensor_shapes, is_quant_part, is_weight_file, layer_file,
    layer_prefix,
    layer_tensor_shapes,
)

# safetensors dtype name <-> torch dtype: the one table for the store; inverse derived.
# The integer rows hold quantised weights' values (shard.quant_weights), never a float weight.
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
                "U8": torch.uint8}
STORE_DTYPE_OF = {v: k for k, v in TORCH_DTYPES.items()}


def cache_root() -> pathlib.Path:
    """Root of shard's on-disk cache: $SHARD_HOME, else ~/.cache/shard. The only reader of SHARD_HOME."""
    env = os.environ.get("SHARD_HOME")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "shard"


def default_store_dir(name: str) -> pathlib.Path:
    return cache_root() / "models" / name


def sha256_file(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# Hashing a file costs a full read. A node re-opening its store in one process (a new ring
# epoch, a heal) must not pay it twice, so verified files are remembered by path, keyed on
# (size, mtime_ns, ctime_ns, inode): any rewrite or replacement of the file invalidates it.
_verified: dict[str, tuple[tuple[int, int, int, int], str]] = {}


def verify_file(path: pathlib.Path, entry: FileEntry, relpath: str) -> None:
    """Raise StoreError if `path` is missing or the wrong size, DigestMismatchError if its
    sha256 differs from the manifest's. Cached per process (see `_verified`)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise StoreError(f"missing store file {relpath} (in {path.parent})") from None
    if st.st_size != entry.bytes:
        raise DigestMismatchError(relpath, entry.sha256, f"<{st.st_size} bytes, manifest says {entry.bytes}>")
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    cached = _verified.get(str(path))
    if cached is not None and cached == (key, entry.sha256):
        return
    actual = sha256_file(path)
    if actual != entry.sha256:
        raise DigestMismatchError(relpath, entry.sha256, actual)
    _verified[str(path)] = (key, actual)


def mark_verified(path: pathlib.Path, sha256: str) -> None:
    """Record that `path` (as it is now) hashed to `sha256`: a fetcher hashed its bytes
    while writing them, so loading it need not read it twice."""
    st = path.stat()
    _verified[str(path)] = ((st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino), sha256)


def stored_weight_files(root: pathlib.Path, manifest: Manifest) -> tuple[str, ...]:
    """The manifest's weight files present under `root` at their full size (one stat each,
    no hashing: a file is verified when it is loaded or first served)."""
    out = []
    for rel, entry in manifest.files.items():
        try:
            if is_weight_file(rel) and (root / rel).stat().st_size == entry.bytes:
                out.append(rel)
        except OSError:
            continue
    return tuple(out)


@dataclass(frozen=True)
class ModelStore:
    """An opened, manifest-validated store dir. Loading methods verify the files they read."""

    root: pathlib.Path
    manifest: Manifest

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> "ModelStore":
        """Read and cross-check `root/manifest.json`. Touches no weight file.

        Error handling: StoreError if the dir or manifest is missing or inconsistent;
        UnsupportedModelError if the config names a family the runtime cannot run.
        """
        root = pathlib.Path(root)
        path = root / MANIFEST_NAME
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"no model store at {root} (missing {MANIFEST_NAME}; run `shard-node prepare`)") from None
        except json.JSONDecodeError as e:
            raise StoreError(f"{path}: not valid JSON ({e})") from None
        return cls(root, Manifest.from_dict(raw, where=str(path)))

    @property
    def config(self) -> ModelConfig:
        return self.manifest.arch

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def num_layers(self) -> int:
        return self.manifest.num_layers

    @property
    def tokenizer_dir(self) -> pathlib.Path:
        return self.root / TOKENIZER_DIR

    def weights_digest(self, r: LayerRange) -> str:
        return self.manifest.weights_digest(r)

    def layer_bytes(self, r: LayerRange) -> int:
        """Bytes on disk of layers [r.start, r.end) as stored, quantised weights at their grid's
        size (for the cost model)."""
        self._check_range(r)
        return sum(self.manifest.layer_bytes[i] for i in r)

    def embedding_bytes(self) -> int:
        """Bytes on disk of the token embedding, which a head stage (layer 0) holds too."""
        return self.manifest.files[EMBED_FILE].bytes

    def load_layers(self, r: LayerRange, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    ) -> dict[int, dict[str, torch.Tensor]]:
        """layer -> {short name ("self_attn.q_proj.weight") -> tensor} for layers in `r`: float
        tensors in `dtype`, a quantised weight's parts as stored (shard.quant_weights).

        Resource handling: reads, hashes and memory-maps only the slice's own files.
        Error handling: StoreError for a range outside the model or a missing file;
        DigestMismatchError for a file whose bytes or tensors differ from the manifest.
        """
        self._check_range(r)
        out = {}
        for i in r:
            tensors = self._load_file(layer_file(i), dtype, device)
            prefix = layer_prefix(i)
            out[i] = {name[len(prefix):]: t for name, t in tensors.items()}
        return out

    def load_embedding(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
        """(vocab, hidden) token embedding."""
        return self._load_file(EMBED_FILE, dtype, device)[EMBED_TENSOR]

    def load_head(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final norm weight (hidden,), LM head (vocab, hidden) or None when tied to the embedding)."""
        tensors = self._load_file(HEAD_FILE, dtype, device)
        return tensors[NORM_TENSOR], tensors.get(LM_HEAD_TENSOR)

    def verify(self) -> None:
        """Hash every file the manifest lists (weights and tokenizer) against it."""
        for rel, entry in self.manifest.files.items():
            verify_file(self.root / rel, entry, rel)

    def _check_range(self, r: LayerRange) -> None:
        if r.end > self.num_layers:
            raise StoreError(f"layer range {r} is outside the model's {self.num_layers} layers")

    def _load_file(self, relpath: str, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
        entry = self.manifest.files[relpath]
        path = self.root / relpath
        verify_file(path, entry, relpath)
        out = {}
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = set(f.keys())
            if names != set(entry.tensors):
                raise DigestMismatchError(relpath, f"tensors {sorted(entry.tensors)}", f"tensors {sorted(names)}")
            for name, want in entry.tensors.items():
                sl = f.get_slice(name)
                got = TensorEntry(tuple(sl.get_shape()), sl.get_dtype())
                if got != want:
                    raise DigestMismatchError(f"{relpath}:{name}", f"{want}", f"{got}")
                t = f.get_tensor(name)
                out[name] = t if is_quant_part(name) else t.to(dtype)
        return out


# ---------------------------------------------------------------------------------------
# prepare: source -> store dir


def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="file", file=sys.stderr)


def _write_tensors(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> FileEntry:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Contiguous private copies: save_file refuses shared storage (tied weights, views).
    save_file({n: t.detach().contiguous().clone() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})
    entries = {n: TensorEntry(tuple(t.shape), STORE_DTYPE_OF[t.dtype]) for n, t in tensors.items()}
    return FileEntry(sha256_file(path), path.stat().st_size, entries)


def _take(source, names_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Fetch tensors by full name from the source, checking each one's shape and dtype; a
    weight the source holds quantised (a GGUF's blocks) is taken as its grid's tensors."""
    from shard.quant_weights import check_shape

    out = {}
    for name, shape in names_shapes.items():
        grid = source.quantised(name)
        if grid is not None:
            check_shape(grid, name, shape)
            out.update(grid.to_tensors(name))
            continue
        t = source.tensor(name)
        if tuple(t.shape) != shape:
            raise UnsupportedModelError(f"shape of {name}", tuple(t.shape), shape)
        if not t.is_floating_point() or t.dtype not in STORE_DTYPE_OF:
            floats = sorted(str(d) for d in STORE_DTYPE_OF if d.is_floating_point)
            raise UnsupportedModelError(f"dtype of {name}", str(t.dtype), floats)
        out[name] = t
    return out


@dataclass(frozen=True)
class PrepareResult:
    store: ModelStore
    created: bool  # False when a valid store was already there and was only verified


def prepare(model: str, out: str | os.PathLike[str] | None = None, *, force: bool = False,
            progress: bool = True) -> PrepareResult:
    """Turn `model` (alias, HF dir or GGUF file) into a store at `out` (default: the cache).

    Idempotent: when `out` already holds a store it is verified and left as is (or
    rebuilt with force=True). The store is built in a sibling temp dir and renamed into
    place, so an interrupted run leaves no half-store behind.

    Error handling: StoreError (missing source or file), UnsupportedModelError (family or
    tensor layout the runtime cannot run), DigestMismatchError (existing store corrupt).
    """
    from shard.sources import open_source

    source = open_source(model)
    out = pathlib.Path(out) if out is not None else default_store_dir(source.name)
    if (out / MANIFEST_NAME).exists() and not force:
        store = ModelStore.open(out)
        store.verify()
        return PrepareResult(store, created=False)
    if out.exists() and not force and any(out.iterdir()):
        raise StoreError(f"{out} exists, is not empty and holds no {MANIFEST_NAME}; pass --force to overwrite it")

    config = source.config()
    arch = ModelConfig.from_hf(config)  # refuses unsupported families before any heavy work
    source.load(progress)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files: dict[str, FileEntry] = {}
        extra = source.layer_tensor_names() - {layer_prefix(i) + n for i in range(arch.num_layers)
                                               for n in layer_tensor_shapes(arch, i)}
        if extra:
            raise UnsupportedModelError("tensor", sorted(extra)[0], f"the {arch.family.layout} layer layout")
        for i in _progress(range(arch.num_layers), f"writing {source.name} layers", progress):
            shapes = {layer_prefix(i) + n: s for n, s in layer_tensor_shapes(arch, i).items()}
            files[layer_file(i)] = _write_tensors(tmp / layer_file(i), _take(source, shapes))
        files[EMBED_FILE] = _write_tensors(tmp / EMBED_FILE, _take(source, embed_tensor_shapes(arch)))
        files[HEAD_FILE] = _write_tensors(tmp / HEAD_FILE, _take(source, head_tensor_shapes(arch)))
        source.save_tokenizer(tmp / TOKENIZER_DIR)
        for path in sorted((tmp / TOKENIZER_DIR).rglob("*")):
            if path.is_file():
                files[path.relative_to(tmp).as_posix()] = FileEntry(sha256_file(path), path.stat().st_size, {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        dtypes = sorted({t.dtype for i in range(arch.num_layers) for n, t in files[layer_file(i)].tensors.items()
                         if not is_quant_part(n)})
        if len(dtypes) != 1:
            raise UnsupportedModelError("mix of layer dtypes", dtypes, "one float dtype per model")
        manifest = Manifest.build(name=source.name, source=source.description, config=config, dtype=dtypes[0],
                                  files=files)
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(ModelStore.open(out), created=True)


def open_or_prepare(model: str, store_dir: str | os.PathLike[str] | None = None, *, progress: bool = True) -> ModelStore:
    """The store for `model`, preparing it only if it is not there yet.

    Unlike prepare(), an existing store is opened without hashing every file: a node
    verifies only the slice it loads (load_layers checks those files' digests), which
    keeps start-up proportional to the slice rather than the model.
    """
    from shard.sources import open_source

    out = pathlib.Path(store_dir) if store_dir is not None else default_store_dir(open_source(model).name)
    if (out / MANIFEST_NAME).exists():
        return ModelStore.open(out)
    return prepare(model, out, progress=progress).store
