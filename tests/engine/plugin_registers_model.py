"""Test plugin (``plugin_modules``): importing it registers the model name
"toy-from-plugin" (the toy pipeline, with the toy's spec)."""

from engine_toy import toy_spec

from diffrt.engine.pipelines import register_model

register_model(toy_spec("toy-from-plugin", "ToyPipeline"))
