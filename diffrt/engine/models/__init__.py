"""Model folders: what a model is before any pipeline runs.

Names and the registry (``registry``: a name or folder -> its ``ModelSpec``,
reading JSON only), folder checks (``folder_check``), loading a diffusers
folder component by component (``loading``), weight file formats
(``gguf_file``), the shipped and embedded models (``shipped``, ``embedded``)
and the tiny seeded folders the embedded models are built from (``tiny/``).
This room sits below ``weights`` and ``pipelines``: it imports neither.
"""
