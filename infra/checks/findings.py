"""What a preflight check answers: one `Finding` per check, a `PreflightResult`, and `PreflightFailed`.

A failed finding stops the run and names its fix. An unchecked one (`checked=False`) could not be verified here and
never fails. No AWS and no Prefect here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hlat.core.config import ConfigError


@dataclass(frozen=True)
class Finding:
    """One check's outcome: `ok` False stops the run; `checked` False means it could not be verified here."""

    check: str
    ok: bool
    message: str
    checked: bool = True

    def line(self) -> str:
        mark = "ok" if self.ok and self.checked else "??" if self.ok else "FAIL"
        return f"preflight {mark:<4} {self.check}: {self.message}"


@dataclass
class PreflightResult:
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def lines(self) -> list[str]:
        return [f.line() for f in self.findings]


class PreflightFailed(ConfigError):
    """The preflight found problems; the message is one line per failure."""

    def __init__(self, failures: list[Finding]) -> None:
        self.failures = failures
        # A source failure reads as the source checks' errors always have ("data.source: ..."); the others name
        # the preflight's check.
        super().__init__(
            "\n".join(f.message if f.check == "source" else f"preflight: {f.check}: {f.message}" for f in failures)
        )
