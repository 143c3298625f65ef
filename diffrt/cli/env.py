"""`diffrt env`: which platform diffrt picked on this machine, why, and what it can do."""

from __future__ import annotations

import argparse
import json
from typing import Any

from diffrt.cli.table import format_pairs
from diffrt.vendor_metadata import VENDOR_PACKAGES, AutoloadFailure, dist_version


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "env", help="show the detected platform, how it was chosen, versions and capabilities",
        description="Show the platform diffrt detected, how it was chosen, torch and vendor "
                    "package versions, and each capability. Run it first on a new machine.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--check", action="store_true",
                   help="run the prepared device check (D2H rates, async == sync outputs, "
                        "output bubble at 1024x1024 with Flux widths, engine overhead) and "
                        "print one JSON; exit 1 when a part fails")
    p.add_argument("--quick", action="store_true",
                   help="with --check: small sizes and tiny widths (a CPU smoke run)")
    p.set_defaults(func=run)


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        pairs: list[tuple[str, Any]] = []
        for key, sub in value.items():
            pairs += _flatten(f"{prefix}.{key}" if prefix else str(key), sub)
        return pairs
    return [(prefix, value)]


def render_report(report: dict[str, Any]) -> str:
    """Scalars first as the summary, then one section per nested mapping."""
    summary = [(str(k), v) for k, v in report.items() if not isinstance(v, dict)]
    sections = [format_pairs(summary, "platform")] if summary else []
    for key, value in report.items():
        if isinstance(value, dict):
            pairs = _flatten("", value)
            sections.append(format_pairs(pairs, str(key)) if pairs else f"{key}\n  -")
    return "\n\n".join(sections)


def autoload_report(failure: AutoloadFailure) -> dict[str, Any]:
    """What ``diffrt env`` can say when ``import torch`` failed in a vendor
    backend: that failure and the installed versions, from package metadata
    (no platform: none can be chosen without torch)."""
    import platform as py_platform

    versions = {"python": py_platform.python_version(), "diffrt": dist_version("diffrt"),
                "torch": dist_version("torch")}
    versions.update({dist: v for dist in VENDOR_PACKAGES if (v := dist_version(dist))})
    return {"platform": None, "reason": failure.line(),
            "torch_backend_autoload_failure": failure.as_dict(), "versions": versions}


def print_autoload_report(failure: AutoloadFailure, as_json: bool) -> None:
    report = autoload_report(failure)
    print(json.dumps(report, indent=2) if as_json else render_report(report))


def run(args: argparse.Namespace) -> int:
    from diffrt.platforms.report import platform_report

    if args.check:
        from diffrt.cli.device_check import CheckOptions, run_check

        result, ok = run_check(CheckOptions.quick() if args.quick else CheckOptions())
        print(json.dumps(result, indent=2, default=str))
        return 0 if ok else 1

    report = platform_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_report(report))
    return 0
