"""diffrt.engine: the public serving API.

```python
from diffrt.engine import DiffusionEngine, EngineConfig, DiffusionRequest, SamplingParams
engine = DiffusionEngine.make_engine(EngineConfig())  # diffrt-shapes, the default
out = engine.generate(DiffusionRequest(prompt="a red circle on a yellow background in the top left"))
```

Heavy modules (the runtime, the pipelines) load on first use of the engine
classes. A vendor backend that fails inside this package's first
``import torch`` (torch_npu or torch_musa built for
another torch) raises ``diffrt.vendor_metadata.BackendAutoloadError``, naming
the package, its version, the torch it needs and
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrt.vendor_metadata import import_naming_backend, naming_backend_failure

with naming_backend_failure():  # the request types' input images import torch
    from diffrt.engine.outputs import DiffusionOutput, RequestMetrics, Rollout, TextEncoderStats
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from diffrt.engine.config import EngineConfig, EngineConfigError, ExecutionMode
    from diffrt.engine.engine import DiffusionEngine
    from diffrt.engine.errors import (
        DeadlineUnmeetableError,
        EngineClosedError,
        EngineDeadError,
        EngineError,
        EngineRestartingError,
        EngineWarmupError,
    )
    from diffrt.engine.lora.adapter_file import AdapterFileError
    from diffrt.engine.lora.registry import LoraExistsError, LoraInfo
    from diffrt.engine.stats import EngineStats, Histogram

_LAZY = {
    "EngineConfig": "diffrt.engine.config",
    "EngineConfigError": "diffrt.engine.config",
    "ExecutionMode": "diffrt.engine.config",
    "DiffusionEngine": "diffrt.engine.engine",
    "EngineError": "diffrt.engine.errors",
    "DeadlineUnmeetableError": "diffrt.engine.errors",
    "EngineClosedError": "diffrt.engine.errors",
    "EngineDeadError": "diffrt.engine.errors",
    "EngineRestartingError": "diffrt.engine.errors",
    "EngineWarmupError": "diffrt.engine.errors",
    "EngineStats": "diffrt.engine.stats",
    "Histogram": "diffrt.engine.stats",
    "AdapterFileError": "diffrt.engine.lora.adapter_file",
    "LoraExistsError": "diffrt.engine.lora.registry",
    "LoraInfo": "diffrt.engine.lora.registry",
}

__all__ = [
    "AdapterFileError",
    "DeadlineUnmeetableError",
    "DiffusionEngine",
    "DiffusionOutput",
    "DiffusionRequest",
    "EngineClosedError",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineError",
    "ExecutionMode",
    "EngineRestartingError",
    "EngineStats",
    "EngineWarmupError",
    "Histogram",
    "InvalidRequestError",
    "LoraExistsError",
    "LoraInfo",
    "RequestMetrics",
    "Rollout",
    "SamplingParams",
    "TextEncoderStats",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_naming_backend(module), name)
