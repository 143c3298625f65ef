"""diffrt.serve: the OpenAI-compatible HTTP server (``diffrt serve``).

```python
from diffrt.engine import EngineConfig
from diffrt.serve import ServeSettings, build_app

app = build_app(EngineConfig(step_execution=True), ServeSettings())  # diffrt-shapes (+ diffrt-motion)
# uvicorn.run(app, host="127.0.0.1", port=8000)
```

``build_app`` is imported when first used, so the command line reads the
server's declarations (``settings.py``) without loading FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diffrt.serve.settings import ServeSettings

if TYPE_CHECKING:
    from diffrt.serve.app import build_app

__all__ = ["ServeSettings", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        # torch's first import: a vendor backend failing inside it is named
        from diffrt.vendor_metadata import import_naming_backend

        return import_naming_backend("diffrt.serve.app").build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
