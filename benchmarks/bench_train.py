"""Training-step throughput: our model against Hugging Face `LlamaForCausalLM` at the same config, batch and
precision, in one run. On CUDA it also reports MFU (peak BF16 FLOP/s of the device from `training.devices`).

    .venv/bin/python -m benchmarks.bench_train                # CPU: a small model, fp32
    python -m benchmarks.bench_train --size 1b --precision bf16 --batch 4 --seq 4096 --json out.json   # a GPU

A step is what the trainer does: forward under autocast (bf16 mixed precision keeps FP32 master weights),
float32 cross-entropy, backward, AdamW (fused on CUDA), on random tokens, with no host sync inside the step; the
same initial weights go into every model. Variants:
- `hlat eager` / `hlat compiled`: our Transformer, eager or with `training.parallel.parallelize.compile_blocks`
  (each block under torch.compile, as `training.compile` does in a job);
- `hlat compiled (doc-masked)`: packed documents (8 per sequence) masked to their own tokens: FlexAttention on CUDA
  (`Transformer.flex_document_mask`), SDPA with a dense mask on CPU;
- `HF eager` / `HF compiled`: `LlamaForCausalLM` (SDPA attention), eager or with each decoder layer compiled;
- `hlat FSDP2`: compiled blocks under FSDP2 as `parallelism.fsdp` sets it up
  (`training.parallel.parallelize.shard_fully`: BF16 parameter gathers, FP32 gradient reduction) in a one-rank
  process group: what the sharding machinery costs without any communication.
MFU counts 6N + 12LdT FLOPs per token (PaLM's convention: the causal mask is not discounted) for every variant.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.measure import best_of, table
from hlat.core.config import ModelConfig
from hlat.training.checkpoint.hf_export import to_hf_state_dict
from hlat.training.devices import peak_flops
from hlat.training.model import Transformer
from hlat.training.models.llama import hf_llama_config
from hlat.training.parallel.parallelize import compile_blocks

SIZES = {
    "small": ModelConfig(n_layers=4, d_model=256, n_heads=8, ffn_hidden=688, vocab_size=2048, max_seq_len=512),
    "1b": ModelConfig(n_layers=16, d_model=2048, n_heads=16, ffn_hidden=5504, vocab_size=32000, max_seq_len=4096),
}
VARIANTS = ["hlat eager", "hlat compiled", "hlat compiled (doc-masked)", "HF eager", "HF compiled", "hlat FSDP2"]
DOCS_PER_SEQUENCE = 8


@dataclass
class Result:
    variant: str
    seconds_per_step: float
    peak_memory_gb: float | None


def doc_ids_for(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Document index of each position: DOCS_PER_SEQUENCE documents of random lengths per row (fixed seed)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=g)[: DOCS_PER_SEQUENCE - 1].add(1).sort().values
        starts = torch.zeros(seq, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows).to(device)  # (B, T)


_OWN_GROUP: list[bool] = []
"""Set when the FSDP2 variant started the one-rank process group (main ends it)."""


def fsdp_model(cfg: ModelConfig, weights: Transformer, device: torch.device, precision: str) -> torch.nn.Module:
    """Our model, compiled per block and sharded by FSDP2 over a one-rank process group."""
    import torch.distributed as dist

    from hlat.core.presets import load_config
    from hlat.training.parallel.distributed import World
    from hlat.training.parallel.parallelize import shard_fully

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWN_GROUP.append(True)
    mode = "bf16-mixed" if precision == "bf16" else "fp32"
    run = load_config("tiny", {"parallelism.fsdp": True, "precision.mode": mode})
    model = Transformer(cfg, device="cpu")
    model.load_state_dict(weights.state_dict())
    compile_blocks(model, device, sharded=True)
    shard_fully(model, run, World(rank=0, world_size=1, local_rank=0, device=device))
    return model


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all but HF compiled)"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    from transformers import LlamaForCausalLM

    variants = [v.strip() for v in args.variants.split(",")] if args.variants else VARIANTS[:-1]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = SIZES[args.size]
    torch.manual_seed(0)
    weights = Transformer(cfg, device="cpu")
    weights.init_weights()
    hf_state = to_hf_state_dict(weights)
    tokens = torch.randint(3, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    doc_ids = doc_ids_for(args.batch, args.seq, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def build(variant: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
        if variant.startswith("HF"):
            hf_config = hf_llama_config(cfg)
            hf_config.use_cache = False  # training: no key/value cache (it also makes Dynamo recompile every layer)
            hf = LlamaForCausalLM(hf_config)
            hf.load_state_dict(hf_state)
            hf.to(device)  # type: ignore[arg-type]
            if variant == "HF compiled":
                for layer in hf.model.layers:
                    layer.compile()
            return hf, lambda: hf(inputs).logits
        if variant == "hlat FSDP2":
            sharded = fsdp_model(cfg, weights, device, args.precision)
            return sharded, lambda: sharded(inputs)
        ours = Transformer(cfg, device=device)
        ours.load_state_dict(weights.state_dict())
        if "compiled" in variant:
            compile_blocks(ours)
        masked = doc_ids if "doc-masked" in variant else None
        return ours, lambda: ours(inputs, masked)

    def measure(variant: str) -> Result:
        model, forward = build(variant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def run() -> None:
            for _ in range(args.steps):
                with autocast:
                    logits = forward()  # (B, T, V)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run()  # warm-up: compilation, allocations, kernel selection
        seconds = best_of(run, args.repeats) / args.steps
        memory = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
        print(f"  {variant}: {seconds * 1000:.0f} ms/step", flush=True)
        return Result(variant, seconds, memory)

    results = []
    for variant in variants:
        results.append(measure(variant))
        gc.collect()  # this variant's model and optimizer state, before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if _OWN_GROUP:
        import torch.distributed as dist

        dist.destroy_process_group()
        _OWN_GROUP.clear()
    n_tokens = args.batch * args.seq
    peak = peak_flops(device)
    fpt = cfg.flops_per_token(args.seq)
    base = next((r.seconds_per_step for r in results if r.variant == "HF eager"), None)
    rows, figures = [], []
    for r in results:
        tps = n_tokens / r.seconds_per_step
        mfu = tps * fpt / peak if peak else None
        ratio = base / r.seconds_per_step if base else None
        rows.append(
            [
                r.variant,
                f"{r.seconds_per_step * 1000:.0f}",
                f"{tps:,.0f}",
                f"{mfu:.1%}" if mfu is not None else "n/a",
                f"{ratio:.2f}x" if ratio is not None else "n/a",
                f"{r.peak_memory_gb:.1f}" if r.peak_memory_gb is not None else "n/a",
            ]
        )
        figures.append({"variant": r.variant, "ms_per_step": r.seconds_per_step * 1e3, "tokens_per_s": tps, "mfu": mfu})
    out = table(["variant", "ms/step", "tokens/s", "MFU", "speed vs HF eager", "peak GB"], rows)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    head = (
        f"{args.size} model ({cfg.num_params() / 1e6:.1f}M params), batch {args.batch} x seq {args.seq}, "
        f"{args.precision}, {name}, torch {torch.__version__}, best of {args.repeats} x {args.steps} steps"
    )
    print(f"{head}\n{out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": head, "peak_flops": peak, "flops_per_token": fpt, "results": figures}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
