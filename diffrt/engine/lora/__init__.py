"""LoRA adapters served per request, mixed in one batch.

The rooms, from a file to pixels:

* ``adapter_file`` — a file (any format diffusers' ``load_lora_weights``
  reads for the family) -> per-layer low-rank factors, checked against the model;
* ``loader`` — the worker's loader thread and its host copies;
* ``registration`` — the engine waits until every worker has read one;
* ``registry`` — names, ids, the requests that hold them (the engine side);
* ``slot_table`` — which adapter sits in which of the ``max_loras`` device slots;
* ``row_lora`` — the device slots' tables and the hooked linear layers that
  add each row's adapters in one call (gathered per row, batched matmuls).
"""
