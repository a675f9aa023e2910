"""Learning-rate schedule, AdamW set-up, stochastic rounding to BF16 and gradient clipping (training/optim.py)."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from torch import nn

from hlat.core.config import TrainingConfig
from hlat.training.optim import (
    AdamWStochasticRounding,
    MasterWeightAdamW,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    lr_at,
    masked_step,
    sr_seed,
    stochastic_round_to_bf16,
)

# HLAT 7B: peak 3e-4, floor 3e-5, 2000 warmup steps, cosine horizon 500k steps.
HLAT_7B = TrainingConfig(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, max_steps=429_000, schedule_steps=500_000)


class TinyModel(nn.Module):
    """A linear layer, a LayerNorm (the 'norm' parameters) and a head: enough to train a regression."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The BF16 values just below and above |x| in magnitude (with x's sign), from the FP32 bit pattern."""
    bits = x.view(torch.int32)
    low = bits & -65536
    high = low + 65536
    return low.view(torch.float32).to(torch.bfloat16), high.view(torch.float32).to(torch.bfloat16)


# -- schedule ----------------------------------------------------------------------------------------------


def cosine(step: int, warmup: int, horizon: int, peak: float, floor: float) -> float:
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (horizon - warmup)))


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 3e-4 / 2000),  # step 0 already learns: (0 + 1) / warmup of the peak
        (999, 3e-4 * 1000 / 2000),
        (1999, 3e-4),  # the last warmup step runs at the peak
        (2000, 3e-4),  # the cosine starts at the peak
        (251_000, (3e-4 + 3e-5) / 2),  # half-way through the decay: the mean of peak and floor
        (100_000, cosine(100_000, 2000, 500_000, 3e-4, 3e-5)),
        (429_000, cosine(429_000, 2000, 500_000, 3e-4, 3e-5)),  # max_steps: the 7B run stops before the horizon
        (500_000, 3e-5),  # the horizon: the floor
        (600_000, 3e-5),  # beyond it: flat at the floor
    ],
)
def test_schedule_at_key_points_hlat_7b(step: int, expected: float) -> None:
    assert lr_at(step, HLAT_7B) == pytest.approx(expected, rel=1e-12)


def test_schedule_shape() -> None:
    warm = [lr_at(s, HLAT_7B) for s in range(2000)]
    assert all(a < b for a, b in itertools.pairwise(warm))
    decay = [lr_at(s, HLAT_7B) for s in range(2000, 500_001, 997)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert min(lr_at(s, HLAT_7B) for s in range(0, 700_000, 1001)) >= 3e-4 / 2000


def test_schedule_horizon_defaults_to_max_steps_and_warmup_can_be_zero() -> None:
    cfg = TrainingConfig(lr=1e-3, min_lr_ratio=0.0, warmup_steps=0, max_steps=100)
    assert lr_at(0, cfg) == pytest.approx(1e-3)
    assert lr_at(50, cfg) == pytest.approx(0.5e-3)
    assert lr_at(100, cfg) == pytest.approx(0.0)
    assert lr_at(150, cfg) == pytest.approx(0.0)
    # A horizon inside the warmup: warm up, then hold the floor.
    short = TrainingConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=5)
    assert lr_at(9, short) == pytest.approx(1e-3)
    assert lr_at(10, short) == pytest.approx(1e-4)


def test_lambda_lr_matches_lr_at_and_resumes_from_its_state_dict() -> None:
    cfg = TrainingConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, max_steps=50)
    model = TinyModel()
    opt = build_optimizer(model, cfg, "fp32")
    sched = build_scheduler(opt, cfg)
    seen = []
    for step in range(70):
        seen.append(opt.param_groups[0]["lr"])  # the lr the optimizer step `step` would use
        opt.step()
        sched.step()
        if step == 29:
            # The scheduler state survives torch.load(weights_only=True) and picks up where it was.
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            opt = build_optimizer(model, cfg, "fp32")
            sched = build_scheduler(opt, cfg)
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
    assert seen == pytest.approx([lr_at(s, cfg) for s in range(70)], rel=1e-12)


# -- AdamW -------------------------------------------------------------------------------------------------


def test_fp32_and_bf16_mixed_use_torch_adamw_on_fp32_params() -> None:
    cfg = TrainingConfig(lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2)
    for precision in ("fp32", "bf16-mixed"):
        opt = build_optimizer(TinyModel(), cfg, precision)
        assert type(opt) is torch.optim.AdamW
        (group,) = opt.param_groups
        assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6 and group["weight_decay"] == 0.2
        assert group["fused"] is False
    with pytest.raises(TypeError, match="FP32 parameters"):
        build_optimizer(TinyModel().to(torch.bfloat16), cfg, "bf16-mixed")
    with pytest.raises(TypeError, match="bfloat16 parameters"):
        build_optimizer(TinyModel(), cfg, "bf16-sr")
    with pytest.raises(ValueError, match="precision"):
        build_optimizer(TinyModel(), cfg, "fp16")


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-sr"])
def test_weight_decay_applies_to_every_parameter_norms_included(precision: str) -> None:
    cfg = TrainingConfig(lr=0.1, weight_decay=0.5)
    model = TinyModel()
    if precision == "bf16-sr":
        model = model.to(torch.bfloat16)
    opt = build_optimizer(model, cfg, precision)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.5
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: the Adam update is 0, only the decay moves the weights
    opt.step()
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.1 * 0.5)
        if precision == "bf16-sr":
            # Rounded stochastically to one of the two BF16 neighbours of the decayed value.
            low, high = bf16_neighbours(expected.float())
            assert torch.all((p == low) | (p == high)), name
        else:
            torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=0, msg=name)
    # The LayerNorm weights (all 1.0) in particular were decayed.
    assert torch.all(model.norm.weight < 1.0)


# -- stochastic rounding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 0.77, 0.99])
@pytest.mark.parametrize("base", [1.0, -1.0, 3.0e-3, -7.5e5])
def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not(base: float, fraction: float) -> None:
    """x lies `fraction` of the way between two adjacent BF16 numbers; the mean of 100k SR samples must be x."""
    n = 100_000
    lo = torch.tensor(base, dtype=torch.bfloat16)
    ulp = (torch.tensor(lo.float().abs().item()).view(torch.int32) + 65536).view(torch.float32).item() - abs(
        lo.float().item()
    )
    x = torch.tensor(abs(lo.float().item()) + fraction * ulp, dtype=torch.float32) * math.copysign(1.0, base)
    x64 = x.double().item()
    samples = stochastic_round_to_bf16(x.expand(n).contiguous(), torch.Generator().manual_seed(7))
    # Each sample is one of the two neighbours, so its standard deviation is ulp * sqrt(p (1 - p)).
    p = (abs(x64) - abs(lo.double().item())) / ulp
    sigma = ulp * math.sqrt(p * (1 - p) / n)
    bias = samples.double().mean().item() - x64
    assert abs(bias) < 4 * sigma, f"bias {bias / ulp:.2e} ulp, 4 sigma = {4 * sigma / ulp:.2e} ulp"
    # Round-to-nearest is off by min(p, 1 - p) ulp, deterministically: far beyond the SR tolerance.
    rtn_bias = x.to(torch.bfloat16).double().item() - x64
    assert abs(rtn_bias) > 25 * sigma
    assert abs(abs(rtn_bias) - min(p, 1 - p) * ulp) < 1e-6 * ulp


def test_stochastic_rounding_returns_one_of_the_two_neighbours() -> None:
    gen = torch.Generator().manual_seed(0)
    # Values over a wide range of magnitudes and both signs, subnormals included.
    x = torch.randn(200_000, generator=gen) * torch.exp2(torch.randint(-140, 120, (200_000,), generator=gen).float())
    rounded = stochastic_round_to_bf16(x, gen)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == x.shape
    low, high = bf16_neighbours(x)
    assert torch.all((rounded == low) | (rounded == high))
    assert torch.all(torch.sign(rounded.float()) * torch.sign(x) >= 0)  # never flips the sign
    # Both neighbours actually occur.
    assert (rounded == low).any() and (rounded == high).any()


def test_stochastic_rounding_special_values() -> None:
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(1000, generator=gen).to(torch.bfloat16)
    assert torch.equal(stochastic_round_to_bf16(exact.float(), gen), exact)  # BF16 values stay put
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    for _ in range(50):
        out = stochastic_round_to_bf16(special, gen).float()
        assert out[0].item() == 0.0 and math.copysign(1, out[0].item()) == 1
        assert out[1].item() == 0.0 and math.copysign(1, out[1].item()) == -1
        assert out[2].item() == math.inf and out[3].item() == -math.inf
        assert math.isnan(out[4].item())
    # NaNs whose payload sits only in the low 16 bits (which the truncation would turn into inf).
    low_payload_nan = torch.tensor([0x7F800001, -0x007FFFFF, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(low_payload_nan).all()
    assert torch.isnan(stochastic_round_to_bf16(low_payload_nan, gen)).all()
    # Beyond the largest BF16 number (3.3895e38) the next value up is inf.
    bf16_max = torch.finfo(torch.bfloat16).max
    big = torch.full((10_000,), 3.395e38)
    out = stochastic_round_to_bf16(big, gen).float()
    assert torch.all((out == bf16_max) | (out == math.inf))
    assert (out == bf16_max).any() and (out == math.inf).any()
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_to_bf16(torch.zeros(3, dtype=torch.float64), gen)


def test_stochastic_rounding_is_deterministic_for_a_seed() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    a = stochastic_round_to_bf16(x, torch.Generator().manual_seed(sr_seed(1234, 10, 3)))
    b = stochastic_round_to_bf16(x, torch.Generator().manual_seed(sr_seed(1234, 10, 3)))
    c = stochastic_round_to_bf16(x, torch.Generator().manual_seed(sr_seed(1234, 11, 3)))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a, c)
    assert len({sr_seed(s, k, i) for s in (0, 1) for k in range(50) for i in range(50)}) == 2 * 50 * 50


def test_tiny_updates_accumulate_under_stochastic_rounding_only() -> None:
    """Adding 1/78 of an ulp 2000 times: SR moves the weight by the sum in expectation, nearest never moves it."""
    ulp = 2.0**-7  # the BF16 spacing in [1, 2)
    delta = ulp / 78
    start = torch.full((4096,), 1.5, dtype=torch.bfloat16)
    sr, rtn = start.clone(), start.clone()
    gen = torch.Generator().manual_seed(3)
    for _ in range(2000):
        sr = stochastic_round_to_bf16(sr.float() + delta, gen)
        rtn = (rtn.float() + delta).to(torch.bfloat16)
    assert torch.equal(rtn, start)  # every update rounded away
    moved = sr.double().mean().item() - 1.5
    assert moved == pytest.approx(2000 * delta, rel=0.02)


# -- the BF16 stochastic-rounding optimizer ----------------------------------------------------------------


def regression_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=gen)
    return x, x[:, :1] * 2.0 - x[:, 1:2] + 0.5


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = regression_batch(step)
        loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bf16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyModel().to(torch.bfloat16)


def test_bf16_sr_optimizer_trains_and_keeps_everything_bf16() -> None:
    cfg = TrainingConfig(lr=3e-3, weight_decay=0.01, seed=5)
    model = bf16_model()
    opt = build_optimizer(model, cfg, "bf16-sr")
    assert isinstance(opt, AdamWStochasticRounding)
    losses = train(model, opt, range(300))
    assert sum(losses[-20:]) / 20 < 0.2 * sum(losses[:20]) / 20
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["step"] == 300
        assert torch.all(state["exp_avg_sq"] >= 0)


def test_bf16_sr_optimizer_resumes_bitwise_from_its_state_dict() -> None:
    """No generator state is saved: the rounding bits depend on (seed, step, parameter index) only."""
    cfg = TrainingConfig(lr=1e-3, weight_decay=0.1, seed=9)
    straight = bf16_model()
    opt = build_optimizer(straight, cfg, "bf16-sr")
    train(straight, opt, range(12))

    first = bf16_model()
    opt = build_optimizer(first, cfg, "bf16-sr")
    train(first, opt, range(6))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    torch.manual_seed(12345)  # the global RNG state must not matter
    resumed = bf16_model(seed=77)
    resumed.load_state_dict(state["model"])
    opt = build_optimizer(resumed, cfg, "bf16-sr")
    opt.load_state_dict(state["opt"])
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    train(resumed, opt, range(6, 12))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name

    # A different seed rounds differently.
    other = bf16_model()
    opt = build_optimizer(other, cfg.model_copy(update={"seed": 10}), "bf16-sr")
    train(other, opt, range(12))
    assert any(not torch.equal(a, b) for a, b in zip(straight.parameters(), other.parameters(), strict=True))


def test_bf16_sr_optimizer_small_learning_rate_still_moves_weights() -> None:
    """Updates of lr = ulp/78 per step: with SR the weights drift by ~steps*lr, with nearest rounding not at all."""
    ulp = 2.0**-7
    lr = ulp / 78
    results = {}
    for stochastic in (True, False):
        weight = nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
        opt = AdamWStochasticRounding([weight], lr=lr, betas=(0.9, 0.95), seed=1, stochastic_rounding=stochastic)
        for _ in range(500):
            weight.grad = torch.ones_like(weight)  # a constant gradient: Adam's normalised step is ~lr
            opt.step()
        results[stochastic] = weight.double().mean().item() - 1.5
    assert results[False] == 0.0
    assert results[True] == pytest.approx(-500 * lr, rel=0.05)


# -- clipping ----------------------------------------------------------------------------------------------


def test_clip_grad_norm_returns_the_pre_clip_norm() -> None:
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(4))
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    b.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    total = torch.cat([a.grad, b.grad]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)
    # max_norm 0: no clipping, the norm is still reported.
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    b.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm(iter([a, b]), 0.0) == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0 and b.grad[1].item() == 4.0
    # Below the limit nothing changes; parameters without gradients are ignored.
    assert clip_grad_norm([a, b, nn.Parameter(torch.zeros(2))], 10.0) == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0
    assert clip_grad_norm([nn.Parameter(torch.zeros(2))], 1.0) == 0.0
    b.grad = torch.tensor([math.nan, 0.0, 0.0, 0.0])
    assert math.isnan(clip_grad_norm([a, b], 1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stochastic_rounding_on_cuda_uses_a_device_generator_and_resumes_bitwise() -> None:
    x = torch.randn(100_000, device="cuda")
    a = stochastic_round_to_bf16(x, torch.Generator(device="cuda").manual_seed(1))
    b = stochastic_round_to_bf16(x, torch.Generator(device="cuda").manual_seed(1))
    assert a.device.type == "cuda" and torch.equal(a.view(torch.int16), b.view(torch.int16))
    low, high = bf16_neighbours(x)
    assert torch.all((a == low) | (a == high))
    cfg = TrainingConfig(lr=1e-3, weight_decay=0.1, seed=9)
    results = []
    for _ in range(2):
        model = bf16_model().cuda()
        opt = build_optimizer(model, cfg, "bf16-sr")
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            # Fixed gradients rather than a backward pass, whose CUDA kernels need not be bitwise deterministic.
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to("cuda", torch.bfloat16)
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results, strict=True))


def _loss_step(model: nn.Module, scale: float = 1.0) -> None:
    torch.manual_seed(3)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(32, 8, dtype=dtype), torch.randn(32, 1, dtype=dtype)
    (((model(x) - y) ** 2).mean() * scale).backward()


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_a_masked_step_applies_or_discards_the_whole_update_without_a_host_read(precision: str) -> None:
    cfg = TrainingConfig(lr=1e-2, warmup_steps=0, max_steps=10)

    def pair() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyModel() if precision == "fp32" else TinyModel().to(torch.bfloat16)
        return model, build_optimizer(model, cfg, precision)

    # Discarded (a non-finite step): the weights, and moments that start from zero, as if it never ran.
    model, opt = pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _loss_step(model, float("nan"))
    masked_step(opt, torch.tensor(False))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    assert moments and all(not t.any() for t in moments)

    # Applied: bitwise the optimizer's own step.
    (model, opt), (plain, plain_opt) = pair(), pair()
    _loss_step(model)
    _loss_step(plain)
    masked_step(opt, torch.tensor(True))
    plain_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(value, plain_opt.state[q][key]), key


def test_master_weight_adamw_is_adamw_on_its_fp64_masters_and_keeps_them_through_a_checkpoint() -> None:
    torch.manual_seed(0)
    model, twin = TinyModel(), TinyModel().double()
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt, ref = MasterWeightAdamW(model.parameters(), **hyper), torch.optim.AdamW(twin.parameters(), **hyper)
    for _ in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            _loss_step(m)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.grad = p.grad.double()  # the masters see the parameters' gradients, as on the device
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        master = opt.state[p]["master"]
        assert master.dtype == torch.float64
        torch.testing.assert_close(master, q.detach(), rtol=1e-12, atol=1e-12)
        assert torch.equal(p.detach(), master.float())

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    fresh = MasterWeightAdamW(model.parameters(), **hyper)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for p in model.parameters():
        assert fresh.state[p]["master"].dtype == torch.float64  # torch's loader would have cast it to float32
        assert torch.equal(fresh.state[p]["master"], opt.state[p]["master"])
        assert fresh.state[p]["step"] == 3


def test_the_optimizer_recipe_follows_the_precision_the_device_and_zero1() -> None:
    from hlat.training.optim import optimizer_recipe

    cfg = TrainingConfig()
    params = list(TinyModel().parameters())
    assert optimizer_recipe(params, cfg, "bf16-mixed", "xla")[0] is MasterWeightAdamW  # HLAT 70B without ZeRO-1
    cls, arguments = optimizer_recipe(params, cfg, "bf16-mixed", "xla", zero1=True)  # ZeRO-1 keeps the masters
    assert cls is torch.optim.AdamW and arguments["fused"] is False
    assert optimizer_recipe(params, cfg, "bf16-sr", "xla")[0] is torch.optim.AdamW  # the NeuronCore rounds
    bf16 = list(TinyModel().to(torch.bfloat16).parameters())
    assert optimizer_recipe(bf16, cfg, "bf16-sr", "cpu")[0] is AdamWStochasticRounding
