"""Command profiles: the engine settings and request fields a command
defaults differently from the engine, each declared once with its reason.

A flag left out means the engine's default (``engine/settings.py``) unless
the command's profile says otherwise: ``serve`` runs a long-lived server
(step execution, eight requests per step, fresh workers after a crash),
``generate`` one burst of prompts (all of them in one batch). A profile's
defaults are shown in the command's ``--help`` (each flag's "default:", and
the group's description) and in the docs (``scripts/settings_docs.py``).
A default is a value, or a ``Rule`` the command applies once it knows the
run (how many prompts, which settings were given).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rule:
    """A default that depends on the run: ``value(prompts, given)`` -> the
    value, or None for the engine's own; ``shown`` says it in --help."""

    shown: str
    value: Callable[[int, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Default:
    """One setting's default in a profile, and why the command picks it."""

    value: Any  # a value, or a Rule
    why: str

    @property
    def shown(self) -> str:
        return self.value.shown if isinstance(self.value, Rule) else repr(self.value)


@dataclass(frozen=True)
class Profile:
    """A command's own defaults: setting or request field name -> ``Default``."""

    command: str
    defaults: Mapping[str, Default] = field(default_factory=dict)

    def fixed(self, names: Any) -> dict[str, Any]:
        """The plain values among ``names`` (the flags' argparse defaults)."""
        return {name: d.value for name, d in self.defaults.items()
                if name in names and not isinstance(d.value, Rule)}

    def shown(self, names: Any) -> dict[str, str]:
        """What --help says for the rules among ``names``."""
        return {name: d.shown for name, d in self.defaults.items()
                if name in names and isinstance(d.value, Rule)}

    def apply(self, settings: dict[str, Any], prompts: int) -> dict[str, Any]:
        """``settings`` with the rules' values where none was given."""
        out = dict(settings)
        for name, d in self.defaults.items():
            if isinstance(d.value, Rule) and name not in out:
                value = d.value.value(prompts, settings)
                if value is not None:
                    out[name] = value
        return out

    def describe(self, names: Any) -> str:
        """The profile's lines for ``names``, for a --help group's description."""
        parts = [f"{name}={d.shown} ({d.why})" for name, d in self.defaults.items()
                 if name in names]
        return f"{self.command}'s own defaults: " + "; ".join(parts) if parts else ""


#: how long an idle engine holds the first of several prompts so the rest join its batch
BURST_WAIT_MS = 20.0


def _burst_window(step: bool) -> Rule:
    mode = "with --step-execution" if step else "without --step-execution"
    return Rule(f"{BURST_WAIT_MS:g} with several prompts, {mode}",
                lambda n, given: BURST_WAIT_MS
                if n > 1 and bool(given.get("step_execution")) is step else None)


_SEEDED = Default(0, "reproducible: request i is seeded seed + i")

SERVE = Profile("serve", {
    "step_execution": Default(True, "previews, progress events and aborts need step "
                                    "boundaries"),
    "max_num_seqs": Default(8, "room for eight requests per step"),
    "unread_output_timeout_s": Default(120.0, "a client that stops reading its stream must "
                                              "not hold its image in shared memory for ever"),
    "restart_workers": Default(True, "a server outlives a crash: fresh workers serve on"),
})
GENERATE = Profile("generate", {
    "max_num_seqs": Default(Rule("the number of prompts", lambda n, given: n),
                            "every prompt joins one batch"),
    "request_batch_max_wait_ms": Default(_burst_window(False), "the burst joins one batch"),
    "step_batch_max_wait_ms": Default(_burst_window(True), "the burst joins one step batch"),
    "seed": _SEEDED,
})
BENCH = Profile("bench", {"seed": _SEEDED})


__all__ = ["BENCH", "BURST_WAIT_MS", "GENERATE", "SERVE", "Default", "Profile", "Rule"]
