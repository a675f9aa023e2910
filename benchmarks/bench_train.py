"""Training-step throughput: our model against Hugging Face `LlamaForCausalLM` at the same config, batch and
precision, in one run. On CUDA it also reports MFU (peak BF16 FLOP/s of the device from `training.devices`).

    .venv/bin/python -m benchmarks.bench_train                # CPU: a small model, fp32
    python -m benchmarks.bench_train --size 1b --precision bf16 --batch 4 --seq 4096   # on a GPU

A step is forward + backward + AdamW on random tokens; the same initial weights go into both models.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from benchmarks.common import best_of, table
from training.config import ModelConfig
from training.devices import peak_flops
from training.hf_export import hf_llama_config, to_hf_state_dict
from training.model import Transformer

SIZES = {
    "small": ModelConfig(n_layers=4, d_model=256, n_heads=8, ffn_hidden=688, vocab_size=2048, max_seq_len=512),
    "1b": ModelConfig(n_layers=16, d_model=2048, n_heads=16, ffn_hidden=5504, vocab_size=32000, max_seq_len=4096),
}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = SIZES[args.size]
    torch.manual_seed(0)
    ours = Transformer(cfg)
    ours.init_weights()
    theirs = LlamaForCausalLM(hf_llama_config(cfg))
    theirs.load_state_dict(to_hf_state_dict(ours))
    tokens = torch.randint(3, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def stepper(model: torch.nn.Module, hf: bool) -> Callable[[], None]:
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def run() -> None:
            for _ in range(args.steps):
                with autocast:
                    logits = model(inputs).logits if hf else model(inputs)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        run()  # warm-up (allocations, kernel selection)
        return run

    t_ours = best_of(stepper(ours, hf=False), args.repeats) / args.steps
    ours.to("cpu")
    t_hf = best_of(stepper(theirs, hf=True), args.repeats) / args.steps
    n_tokens = args.batch * args.seq
    peak = peak_flops(device)
    fpt = cfg.flops_per_token(args.seq)

    def row(name: str, t: float, ratio: str) -> list[str]:
        mfu = f"{n_tokens / t * fpt / peak:.1%}" if peak else "n/a"
        return [name, f"{t * 1000:.0f}", f"{n_tokens / t:,.0f}", mfu, ratio]

    out = table(
        ["model", "ms/step", "tokens/s", "MFU", "speed vs HF"],
        [row("hlat Transformer", t_ours, f"{t_hf / t_ours:.2f}x"), row("HF LlamaForCausalLM", t_hf, "1.00x")],
    )
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"{args.size} model ({cfg.num_params() / 1e6:.1f}M params), batch {args.batch} x seq {args.seq}, "
        f"{args.precision}, {name}, best of {args.repeats} x {args.steps} steps\n{out}"
    )
    return out


if __name__ == "__main__":
    main()
