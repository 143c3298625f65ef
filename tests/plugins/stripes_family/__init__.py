"""A model family from outside diffrt, following docs/pipelines.md's "Adding
a family" checklist and touching no file under ``diffrt/``: importing this
package (``EngineConfig(plugin_modules=["plugins.stripes_family"])``)
registers it.

"stripes" folders (``tiny_folder.py`` writes one) hold a diffusers-style
``model_index.json`` naming ``StripesPipeline`` and one component,
``painter``: a config and a safetensors file with one weight per colour
channel. Its pipeline (``pipeline.py``) is a flow-matching family on the
shared contract (docs/families.md): it supplies its encoder, its
transformer call, its latent layout and its decode, and the shared denoise
loop runs it in both execution modes. It denoises toward horizontal
stripes whose colours come from the prompt and the weights, from the
seed's noise and through every step, so a mixed-up, mis-batched or
mis-stepped request shows in its pixels.
"""

from diffrt.engine.pipelines import Family, register_family

FAMILY = Family("stripes", diffusers_pipelines=("StripesPipeline",), transformer_classes=(),
                describe="plugins.stripes_family.spec:describe", diffusers=False)

register_family(FAMILY)
