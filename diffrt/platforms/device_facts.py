"""What a CUDA or ROCm device is, asked without creating a device context here.

The engine process checks a config against the device (``quantization="fp8"``
needs float8 matmuls, ``dtype="auto"`` native bfloat16) but must not start
the device there: ``torch.cuda.get_device_capability()``,
``get_device_properties()`` and ``is_bf16_supported()`` initialise the CUDA
runtime and create a context (hundreds of MiB of device memory held for the
engine's life, and a fork after it is poisoned). So where this process has
no context yet, a short-lived child process answers (once per process and
visibility setting); where it has one (a worker), torch is asked directly.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType

logger = logging.getLogger(__name__)

#: seconds the child may take (it imports torch and initialises the driver)
PROBE_TIMEOUT_S = 60.0
#: the variables that decide which device is device 0 of this process
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

#: run in the child: the facts of device 0 as JSON, or null without a device
#: (torch's vendor backends are not autoloaded: they play no part here)
CHILD_CODE = """
import json, torch
c = torch.cuda
if not c.is_available() or c.device_count() == 0:
    print("null")
else:
    p = c.get_device_properties(0)
    print(json.dumps({"capability": [p.major, p.minor],
                      "arch": getattr(p, "gcnArchName", "") or "",
                      "bf16": bool(c.is_bf16_supported(including_emulation=False))}))
"""


@dataclass(frozen=True)
class DeviceFacts:
    """Device 0 (or the selected device) of this process."""

    #: compute capability (major, minor); ROCm reports its own numbers here
    capability: tuple[int, int]
    #: ROCm's ``gcnArchName`` without its feature suffix ("gfx942"); "" on CUDA
    arch: str
    #: bfloat16 computed natively (``is_bf16_supported(including_emulation=False)``)
    bf16_native: bool


def base_arch(gcn_arch_name: str) -> str:
    """"gfx942:sramecc+:xnack-" -> "gfx942"."""
    return gcn_arch_name.split(":")[0].strip()


def has_context(module: ModuleType) -> bool:
    """Whether this process already initialised the device runtime
    (``torch.cuda.is_initialized()``): asking it directly costs nothing more."""
    check = getattr(module, "is_initialized", None)
    try:
        return bool(check()) if callable(check) else False
    except Exception:  # a module that cannot tell: assume not, ask a child
        return False


def _ask_here(module: ModuleType, index: int) -> DeviceFacts:
    props = module.get_device_properties(index)
    check = module.is_bf16_supported
    try:
        bf16 = bool(check(including_emulation=False))
    except TypeError:  # a build whose check takes no keyword
        bf16 = bool(check())
    return DeviceFacts((int(props.major), int(props.minor)),
                       base_arch(getattr(props, "gcnArchName", "") or ""), bf16)


def run_child() -> str:
    """The child's output (its last line)."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD_CODE], capture_output=True, text=True,
                         timeout=PROBE_TIMEOUT_S, check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def parse_child(line: str) -> DeviceFacts | None:
    data = json.loads(line)
    if data is None:
        return None
    major, minor = data["capability"]
    return DeviceFacts((int(major), int(minor)), base_arch(str(data["arch"])), bool(data["bf16"]))


@functools.lru_cache(maxsize=8)
def _child_facts(visibility: tuple[str | None, ...]) -> DeviceFacts | None:
    """Device 0's facts from a child process; None when it has no device or
    fails (callers then answer "not supported": the safe side)."""
    try:
        return parse_child(run_child())
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, TypeError,
            IndexError) as exc:
        logger.warning("asking a child process for the device's capability failed: %s", exc)
        return None


def device_facts(module: ModuleType, index: int = 0) -> DeviceFacts | None:
    """The facts of device ``index`` of ``module`` (``torch.cuda``): asked
    directly where this process has a context already, else of device 0
    through a child process, so no context is created here."""
    if has_context(module):
        return _ask_here(module, index)
    return _child_facts(tuple(os.environ.get(v) for v in VISIBILITY_VARS))


def clear_cache() -> None:
    """Forget the children's answers (tests)."""
    _child_facts.cache_clear()


__all__ = ["DeviceFacts", "base_arch", "clear_cache", "device_facts", "has_context"]
