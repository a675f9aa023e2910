"""How many tokens a run draws from each source of its mixture, and whether that repeats a source too often.

Step s draws `tokens_per_step` times the source's weight at s (`DataConfig.weights_at`). Epochs divide those tokens by
the source's size: declared before preparation, measured after.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hlat.core.config import ConfigError, HlatConfig


@dataclass(frozen=True)
class SourceDraw:
    name: str
    share: float
    """Its share of the run's training tokens, averaged over the steps."""
    tokens: int
    available: int | None
    """Its training tokens, declared or measured; None: unknown yet."""
    max_epochs: float | None

    @property
    def epochs(self) -> float | None:
        return self.tokens / self.available if self.available else None

    @property
    def over(self) -> bool:
        epochs = self.epochs
        return epochs is not None and self.max_epochs is not None and epochs > self.max_epochs + 1e-9


def source_draws(cfg: HlatConfig, measured: dict[str, int] | None = None) -> list[SourceDraw]:
    """Per source: share, tokens drawn, size (`measured[name]`, else declared) and epochs."""
    data, steps = cfg.data, cfg.training.max_steps
    names = [s.resolved_name for s in data.mixture]
    bounds = [*sorted({0, *(e.step for e in data.schedule if e.step < steps)}), steps]
    drawn = dict.fromkeys(names, 0.0)
    for start, end in itertools.pairwise(bounds):
        for name, weight in data.weights_at(start).items():
            drawn[name] += weight * (end - start)
    total = cfg.tokens_per_step
    out = []
    for source in data.mixture:
        name = source.resolved_name
        available = (measured or {}).get(name) or source.tokens
        out.append(
            SourceDraw(
                name=name,
                share=drawn[name] / steps,
                tokens=round(drawn[name] * total),
                available=available,
                max_epochs=source.max_epochs,
            )
        )
    return out


def check_repetition(cfg: HlatConfig, measured: dict[str, int] | None = None) -> list[SourceDraw]:
    """The draws, or a ConfigError naming each source repeated past its max_epochs, with numbers and fixes."""
    draws = source_draws(cfg, measured)
    over = [d for d in draws if d.over]
    if over:
        lines = [
            f"data.sources[{d.name}]: the run draws {d.tokens:,} tokens from it = {d.epochs:.2f} epochs of its "
            f"{d.available:,} tokens, more than its max_epochs={d.max_epochs:g}"
            for d in over
        ]
        raise ConfigError(
            "\n".join(lines) + "\nlower its weight, add data, shorten training.max_steps, or raise max_epochs"
        )
    return draws


def draws_table(draws: list[SourceDraw]) -> list[str]:
    rows = [("source", "share", "tokens drawn", "source tokens", "epochs")]
    for d in draws:
        size = f"{d.available:,}" if d.available else "unknown"
        epochs = f"{d.epochs:.2f}" if d.epochs is not None else "?"
        limit = f" (max {d.max_epochs:g})" if d.max_epochs is not None else ""
        rows.append((d.name, f"{d.share:.1%}", f"{d.tokens:,}", size, epochs + limit))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
