"""Noise injection into one layer at a time and the loss increase it causes (KL from the original,
or next-token cross-entropy on the text): the measurement behind a_l."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from qpalette.calibration.evaluator import BlockEvaluator, linear_layers, module_device, ref_cache_budget


def noise_levels(levels: int, t_max: float = 1.0) -> list[float]:
    """t_i = t_max · i / levels, i = 1..levels."""
    return [t_max * i / levels for i in range(1, levels + 1)]


def fit_through_origin(t: Iterable[float], y: Iterable[float]) -> tuple[float, float]:
    """Least squares y ≈ a·t² through the origin → (a, R²); R² is the usual centred one."""
    x = [ti * ti for ti in t]
    y = list(y)
    sxx = sum(xi * xi for xi in x)
    a = sum(xi * yi for xi, yi in zip(x, y)) / sxx
    mean = sum(y) / len(y)
    ss_res = sum((yi - a * xi) ** 2 for xi, yi in zip(x, y))
    ss_tot = sum((yi - mean) ** 2 for yi in y)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return a, r2


def noise_seed(seed: int, layer_index: int, level: int) -> int:
    """Seed of ε for (run seed, layer index in model order, level index 1..L; 0: shared)."""
    return (seed * 1_000_003 + layer_index * 10_007 + level * 101 + 12_345) % (2**62)


def noise_direction(shape, seed: int, layer_index: int, level: int, device) -> torch.Tensor:
    """ε/‖ε‖_F (float32) for one (layer, level), generated on `device`."""
    g = torch.Generator(device=device).manual_seed(noise_seed(seed, layer_index, level))
    eps = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return eps.div_(torch.linalg.vector_norm(eps))


# --------------------------------------------------------------------------- measuring layers


@dataclass
class Settings:
    seed: int
    levels: int
    t_max: float
    batch_size: int
    dtype: str
    directions: str = "shared"
    loss: str = "kl"  # kl: KL(original ‖ perturbed); ce: increase of next-token cross-entropy


def layer_deltas(model, tokens: torch.Tensor, todo: list[str], settings: Settings, device,
                 tick: Callable[[], None] = lambda: None) -> Iterator[tuple[str, list[float], float]]:
    """(name, loss increase at every level, seconds) of each layer named in `todo`, in model order
    (the block cache only moves forward); the measurement starts at the first `next`. `device`:
    where the model runs (one device; the evaluator follows a model split over several)."""
    wanted = set(todo)
    budget = ref_cache_budget(module_device(model.lm_head, device))  # the reference log-probs stay by the head
    ev = BlockEvaluator(model, tokens, settings.batch_size, device, budget)
    ev.prepare(settings.loss)
    for k, (name, mod, block) in enumerate(linear_layers(model, targets=[".*"], ignore=[])):  # k seeds the noise
        if name in wanted:
            t0 = time.perf_counter()
            ev.advance_to(block)
            dkl = perturbed_kl(ev, mod.weight, k, settings, tick)
            yield name, dkl, time.perf_counter() - t0


def perturbed_kl(ev: BlockEvaluator, w: torch.Tensor, layer_index: int, settings: Settings,
                 tick: Callable[[], None]) -> list[float]:
    """The loss increase at every noise level of the weight `w` (of layer `layer_index` in model
    order): mean KL, or mean cross-entropy minus the unperturbed one; `w` is restored exactly (from
    a saved copy, not W − noise) afterwards. The noise is drawn on `w`'s device."""
    device = w.device
    original = w.detach().clone()
    w0 = original.float()
    norm = float(torch.linalg.vector_norm(w0))
    dkl = []
    try:
        shared = None
        if settings.directions == "shared":
            shared = noise_direction(w.shape, settings.seed, layer_index, 0, device)
        for i, t in enumerate(noise_levels(settings.levels, settings.t_max), start=1):
            eps = shared if shared is not None else noise_direction(
                w.shape, settings.seed, layer_index, i, device)
            with torch.no_grad():
                w.copy_((w0 + eps * (t * norm)).to(w.dtype))
            del eps
            dkl.append(ev.mean_kl() if settings.loss == "kl" else ev.mean_nll() - ev.base_nll)
            tick()
    finally:
        with torch.no_grad():
            w.copy_(original)
    return dkl


