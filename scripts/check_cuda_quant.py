"""Checks only a GPU can run for weight-only quantisation (shard.quant on CUDA); exits 1 on any failure.

Run where a CUDA device is lent: `python scripts/check_cuda_quant.py [--json OUT]` (about a
minute; needs torch with CUDA and sm80+ for the int4 kernel; no model files, no network).
What it checks, each against the bounds tests/shard/test_quant.py holds the CPU to:
  1. grid: every scheme quantised on CUDA holds the grid the CPU computes from the same
     f32 weight (nibbles / int8 values, scales, zeros), at SmolLM2's shapes and 4096x4096;
  2. product: each CUDA linear's output, for 1, 8 and 512 rows, is F.linear on its own
     dequantised weight within 2^-7 (|x| @ |W|^T) (bf16 activations), and the CPU kernel's
     output within twice that;
  3. stored grids: a GGUF-style grid (shard.quant_weights.QuantWeight: int4 nibbles with
     scales and zeros, int8 values with scales) built straight onto CUDA multiplies by the
     same weight as on the CPU, bit for bit (no requantisation on either device);
  4. a stage: a seeded Llama-shaped stage of 2 layers (--stage-layers; --only-stage runs this
     step alone) quantised int8 / int4 on CUDA against the same stage on the CPU (prefill 16
     + a 3-row chain): within the stage bound
     4 x 2^-7 x layers of the row RMS, and what the auditor's CPU replay of an honest
     CUDA stage would see (coordinator.trust.tolerance.stage_tolerance: pass/fail reported,
     and a failure here means an honest GPU stage would be accused: a finding, exit 1);
  5. speed (reported, never a failure): 1- and 8-row products at 4096x4096 for bf16
     F.linear, int8 and int4, best of 50 with CUDA synchronised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from shard.arch import ModelConfig
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.manifest import layer_tensor_shapes
from shard.quant import SCHEMES, quantise_stage
from shard.quant_weights import QuantWeight
from shard.stage import Stage

U = 2.0 ** -8  # bf16's unit roundoff
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (200, 1536), (4096, 4096)]
ROWS = (1, 8, 512)
failures: list[str] = []
report: dict[str, object] = {}
DEVICE = "cuda"  # --device cpu runs every step CPU against CPU: the script's own self-test, no GPU claim
STAGE_LAYERS = 2  # --stage-layers


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2 * U * (x.abs() @ w.abs().T) * 1.01 + 1e-6  # (T, N)


def check_linears() -> None:
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
        for name in ("int8", "int4", "int4-g64", "int4-g128"):
            q = SCHEMES[name]
            if q.group_size and k % q.group_size:
                continue
            cpu, gpu = q.linear(w), q.linear(w.to(DEVICE))
            deq = gpu.dequantised().cpu()
            mismatch = float((deq != cpu.dequantised()).float().mean())
            # A tie in round() may fall the other way on another device: one element in 10^4.
            check(mismatch <= 1e-4, f"grid {name} {n}x{k}: CUDA's equals the CPU's (mismatched {mismatch:.1e})")
            for t in ROWS:
                x = torch.randn(t, k, generator=gen)
                y = gpu(x.to(DEVICE)).cpu()
                b = bound(x, deq)
                check(bool(((y - F.linear(x, deq)).abs() <= b).all()), f"product {name} {n}x{k} {t} rows: within bf16")
                check(bool(((y - cpu(x)).abs() <= 2 * b).all()), f"product {name} {n}x{k} {t} rows: CUDA vs CPU kernel")


def check_stored_grids() -> None:
    gen = torch.Generator().manual_seed(1)
    n, k = 200, 576
    bf16 = torch.bfloat16  # scales and zeros as a store holds them
    grids = [QuantWeight("int4", torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                         (torch.rand(n, k // 32, generator=gen) * 0.02).to(bf16),
                         (torch.randn(n, k // 32, generator=gen) * 0.01).to(bf16)),
             QuantWeight("int8", torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
                         (torch.rand(n, generator=gen) * 0.01).to(bf16))]
    for g in grids:
        cpu, gpu = g.linear(device="cpu"), g.linear(device=DEVICE)
        check(torch.equal(gpu.dequantised().cpu(), cpu.dequantised()) and torch.equal(cpu.dequantised(), g.dequantised()),
              f"stored {g.kind} grid: the same weight on CUDA and CPU, as stored")
        x = torch.randn(8, k, generator=gen)
        y = gpu(x.to(DEVICE)).cpu()
        check(bool(((y - F.linear(x, g.dequantised())).abs() <= bound(x, g.dequantised())).all()),
              f"stored {g.kind} grid: CUDA product within bf16")


def tiny_llama(layers: int = 2) -> tuple[ModelConfig, dict[int, dict[str, torch.Tensor]]]:
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)
    cfg = ModelConfig.from_hf(hf)
    gen = torch.Generator().manual_seed(2)
    weights = {i: {n: (1 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else 0.06 * torch.randn(s, generator=gen)
                   for n, s in layer_tensor_shapes(cfg, i).items()} for i in range(cfg.num_layers)}
    return cfg, weights


def run_stage(cfg, weights, name: str, device: str) -> torch.Tensor:
    r = LayerRange(0, cfg.num_layers)
    w = {i: {n: t.to(device) for n, t in ts.items()} for i, ts in weights.items()}
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(device)
    stage = quantise_stage(Stage(cfg, r, w, device=device, embedding=emb), SCHEMES[name])
    job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 24, device).open("j", 32)
    ids = torch.arange(5, 21, device=device)
    a, _ = stage.forward(job, ids, ctx_len=0, positions=torch.arange(16, device=device))
    b, _ = stage.forward(job, ids[:3], ctx_len=16, positions=torch.arange(16, 19, device=device))
    return torch.cat([a, b]).cpu()


def check_stage() -> None:
    from coordinator.trust.tolerance import stage_tolerance
    from receipts.spotcheck import compare_outputs

    cfg, weights = tiny_llama(STAGE_LAYERS)
    report["stage_layers"] = cfg.num_layers
    for name in ("none", "int8", "int4"):
        cpu, gpu = run_stage(cfg, weights, name, "cpu"), run_stage(cfg, weights, name, DEVICE)
        rms = cpu.pow(2).mean(dim=1, keepdim=True).sqrt()
        worst = float(((gpu - cpu).abs() / rms).max())
        report[f"stage_{name}_max_err_over_row_rms"] = worst
        check(worst <= 4 * 2 * U * cfg.num_layers, f"stage {name} on CUDA vs CPU: {worst:.2e} of the row RMS")
        audit = compare_outputs(cpu.numpy(), gpu.numpy(), stage_tolerance("f32", name), scale=rms.expand_as(cpu).numpy())
        report[f"stage_{name}_audit_outlier_fraction"] = audit.outlier_fraction
        check(audit.passed, f"stage {name}: a CPU auditor's replay accepts the honest CUDA stage "
                            f"(outliers {audit.outlier_fraction:.1e}, allowed {audit.tolerance.max_outlier_fraction:.0e})")


def measure_speed() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4096, 4096, generator=gen)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    lins = {"bf16": lambda x, wb=w.to(DEVICE).bfloat16(): F.linear(x.bfloat16(), wb),
            "int8": SCHEMES["int8"].linear(w.to(DEVICE)), "int4": SCHEMES["int4"].linear(w.to(DEVICE))}
    for t in (1, 8):
        x = torch.randn(t, 4096, generator=gen).to(DEVICE)
        for name, lin in lins.items():
            for _ in range(5):
                lin(x)
            best = float("inf")
            for _ in range(50):
                sync()
                t0 = time.perf_counter()
                lin(x)
                sync()
                best = min(best, time.perf_counter() - t0)
            report[f"speed_{name}_{t}rows_us"] = best * 1e6
            print(f"speed 4096x4096 {t} rows {name}: {best * 1e6:.1f} us", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the figures and failures here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the script's self-test only")
    ap.add_argument("--no-speed", action="store_true", help="skip the (never failing) speed figures")
    ap.add_argument("--stage-layers", type=int, default=2, help="layers of step 4's seeded stage (its error grows with depth)")
    ap.add_argument("--only-stage", action="store_true", help="step 4 alone")
    args = ap.parse_args(argv)
    global DEVICE, STAGE_LAYERS
    DEVICE, STAGE_LAYERS = args.device, args.stage_layers
    failures.clear()
    report.clear()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("FAIL  no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if DEVICE == "cuda":
        report.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                      torch=torch.__version__, cuda=torch.version.cuda)
        print(f"{report['device']} sm{''.join(map(str, report['capability']))} torch {torch.__version__}", flush=True)
    steps = [check_stage] if args.only_stage else [check_linears, check_stored_grids, check_stage] + (
        [] if args.no_speed else [measure_speed])
    for step in steps:
        try:
            step()
        except Exception as e:  # a kernel or packing that does not exist on this device is a failure to report
            check(False, f"{step.__name__}: {type(e).__name__}: {e}")
    report["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{len(failures)} failure(s)" if failures else "all CUDA quantisation checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
