"""Reuse of the transformer's work between denoise steps, per request.

A request that asks for a step cache (``SamplingParams.cache``) decides at
every step, alone, whether its transformer call can reuse what it computed
at an earlier step (``policies``): First-Block Cache compares the first
block's residual with the one of its last computed step, TeaCache
accumulates the change of the first block's modulated input. The decision
covers all its rows (its outputs and both CFG branches). Inside a step batch
requests that reuse skip the blocks, those that do not run them as a
sub-batch of the same call (``forward``); rows without a cache run as
always. What a request keeps between steps is its ``RequestCache``
(``state``), in its worker state, counted against ``cache_state_bytes``
and freed with the request.

A family takes part by giving its transformer call cut at its blocks
(``forward.TransformerBlocks``); ``ModelSpec.cache`` says which policies it
serves and carries a checkpoint's calibration.
"""
