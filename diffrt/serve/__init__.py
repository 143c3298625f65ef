"""diffrt.serve: the OpenAI-compatible HTTP server (``diffrt serve``).

```python
from diffrt.engine import EngineConfig
from diffrt.serve import ServeSettings, build_app

app = build_app(EngineConfig(step_execution=True), ServeSettings())  # diffrt-shapes
# uvicorn.run(app, host="127.0.0.1", port=8000)
```
"""

from diffrt.serve.app import build_app
from diffrt.serve.settings import ServeSettings

__all__ = ["ServeSettings", "build_app"]
