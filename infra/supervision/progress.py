"""What a stage reports while its job runs: the progress line, its throughput, and when to log it.

Throughput is measured over a window of observed steps, not the trainer's per-step reading.
The job's own output is forwarded to the log; its step lines only at the debug level."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from hlat.core.contract import parse_step_line

job_log = logging.getLogger("hlat.job")


@dataclass
class Progress:
    """What the stage reports while a job runs."""

    attempt: int
    job_name: str
    status: str
    step: int | None = None
    target_step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    cost_usd: float = 0.0
    final: bool = False
    """The job has ended: tokens_per_s is the attempt's average, and there is no ETA."""
    startup_s: float | None = None
    """Seconds from submission to the first logged step, shown apart from the average (final line only)."""

    @property
    def fraction(self) -> float:
        return min(1.0, (self.step or 0) / self.target_step) if self.target_step else 0.0

    def line(self) -> str:
        parts = [f"attempt {self.attempt} {self.job_name} {self.status}"]
        if self.step is not None:
            parts.append(f"step {self.step}/{self.target_step}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s:
            # The attempt's average is wall-clock from its first logged step to its last (checkpoints and
            # evaluations included); the start-up before the first step is shown apart.
            parts.append(f"{self.tokens_per_s:,.0f} tok/s" + (" average" if self.final else ""))
        if self.final and self.startup_s is not None:
            parts.append(f"start-up {duration(self.startup_s)}")
        if self.eta_s is not None and not self.final:
            parts.append(f"ETA {duration(self.eta_s)}")
        parts.append(f"${self.cost_usd:,.2f} spent")
        return ", ".join(parts)


class Throughput:
    """Tokens per second of one job, from the steps it logs as the supervisor sees them arrive.

    The trainer's own reading is one sync point's mean step time: it jumps on a step that checkpoints, evaluates
    or compiles (an ETA that followed it swung between 38 s and 56 min in one run). So the rate is the steps gained
    over a window of recent observations (at least `window_s` of them, when there are), and the attempt's average
    is the steps gained over the time between its first and last observation; the trainer's readings stand in
    only until two observations exist."""

    def __init__(self, tokens_per_step: int, window_s: float) -> None:
        self.tokens_per_step, self.window_s = tokens_per_step, window_s
        self.recent: deque[tuple[float, int]] = deque()
        self.first: tuple[float, int] | None = None
        self.readings: list[float] = []

    def observe(self, now: float, step: int, reading: float | None) -> None:
        """The newest step seen at `now` (one call per poll), with the trainer's tokens/s for it."""
        if reading:
            self.readings.append(reading)
        if self.recent and step <= self.recent[-1][1]:
            return
        self.recent.append((now, step))
        self.first = self.first or (now, step)
        # Keep one observation at or before the window's start: the rate then spans the whole window.
        while len(self.recent) > 2 and self.recent[1][0] <= now - self.window_s:
            self.recent.popleft()

    def _between(self, start: tuple[float, int] | None) -> float | None:
        if start is None or not self.recent or self.recent[-1][0] <= start[0]:
            return None
        (t0, s0), (t1, s1) = start, self.recent[-1]
        return (s1 - s0) * self.tokens_per_step / (t1 - t0)

    def rate(self) -> float | None:
        """Tokens/s over the recent window (the trainer's last reading before there is a window)."""
        rate = self._between(self.recent[0] if self.recent else None)
        return rate if rate is not None else (self.readings[-1] if self.readings else None)

    def average(self) -> float | None:
        """Tokens/s over the attempt: tokens gained over the time they took (the readings' mean as a fallback)."""
        rate = self._between(self.first)
        return rate if rate is not None else (sum(self.readings) / len(self.readings) if self.readings else None)

    def span(self) -> float | None:
        """Seconds between the first and the newest step seen (what `average` is measured over; None: no span)."""
        if self.first is None or not self.recent or self.recent[-1][0] <= self.first[0]:
            return None
        return self.recent[-1][0] - self.first[0]


class ProgressGate:
    """When the progress line goes to the log: the first, each change of status and the final one at once; a new
    step at most every `every_s`; the same line again only after `quiet_s` (a heartbeat that shows the job and
    its bill still going). The progress artifact is updated on every poll regardless."""

    def __init__(self, every_s: float, quiet_s: float) -> None:
        self.every_s, self.quiet_s = every_s, quiet_s
        self.printed_at: float | None = None
        self.shown: tuple[str, int | None] | None = None

    def due(self, p: Progress, now: float) -> bool:
        key = (p.status, p.step)
        if p.final or self.printed_at is None or self.shown is None or p.status != self.shown[0]:
            due = True
        else:
            due = now - self.printed_at >= (self.quiet_s if key == self.shown else self.every_s)
        if due:
            self.printed_at, self.shown = now, key
        return due


def absorb(lines: list[str], progress: Progress, meter: Throughput, now: float, tokens_per_step: int) -> bool:
    """Forward job output to our log and pick up progress; True when a new step was seen. The trainer's step
    lines go to the debug level only: the progress line sums them up (they stay in the job's own log and in
    metrics.jsonl), and a job logging every step would otherwise fill the terminal."""
    advanced, reading = False, None
    for line in lines:
        parsed = parse_step_line(line)
        if parsed is None:
            job_log.info("%s", line)
            continue
        job_log.debug("%s", line)
        advanced = advanced or parsed.step != progress.step
        progress.step = parsed.step
        progress.loss = parsed.loss
        reading = parsed.tokens_per_s
    if advanced and progress.step is not None:
        meter.observe(now, progress.step, reading)
        progress.tokens_per_s = meter.rate()
        if progress.tokens_per_s:
            progress.eta_s = (progress.target_step - progress.step) * tokens_per_step / progress.tokens_per_s
    return advanced


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
