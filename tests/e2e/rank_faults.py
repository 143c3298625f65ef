"""Test plugin (``plugin_modules=["rank_faults"]``): faults on one rank only.

A prompt containing ``fault-step:rank1`` makes rank 1's denoise step raise
(inside work the ranks share); ``fault-admit:rank1`` makes rank 1's
admission of it raise (local work). Other ranks and prompts run as usual.
"""

from __future__ import annotations

import torch.distributed as dist

from diffrt.engine.pipelines.flow_match import FlowMatchPipeline

_denoise = FlowMatchPipeline.denoise_step
_admit = FlowMatchPipeline.prepare_encode_batch


def _on_rank1(states, tag: str) -> bool:
    return (dist.is_initialized() and dist.get_rank() == 1
            and any(tag in s.request.prompt for s in states))


def denoise_step(self, states):
    if _on_rank1(states, "fault-step:rank1"):
        raise RuntimeError("injected fault in a shared step")
    return _denoise(self, states)


def prepare_encode_batch(self, states):
    if _on_rank1(states, "fault-admit:rank1"):
        raise RuntimeError("injected fault in admission")
    return _admit(self, states)


FlowMatchPipeline.denoise_step = denoise_step
FlowMatchPipeline.prepare_encode_batch = prepare_encode_batch
