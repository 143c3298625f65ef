"""Test plugin (``plugin_modules``): importing it registers the model name
"toy-from-plugin" (the toy pipeline)."""

from diffrt.engine.pipelines import register_pipeline

register_pipeline("toy-from-plugin", "engine_toy:ToyPipeline")
