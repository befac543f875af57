"""The engine's host side: requests, KV pages, continuous batching.

* ``sampling_params``: ``SamplingParams``, validated per request;
* ``sequence``: ``Sequence`` and ``SequenceStatus``, one request's tokens, KV progress and pages;
* ``block_manager``: ``BlockManager``, pages with ref counts and speculative reserve/commit;
* ``scheduler``: ``Scheduler`` (decode-first continuous batching, chunked prefill, recompute
  preemption, stop handling) and the ``ScheduledBatch`` it hands the model runner.

These modules never import torch, so they are tested on any machine.
"""

from .block_manager import BlockManager
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, ScheduledChunk, Scheduler
from .sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManager",
    "SamplingParams",
    "ScheduledBatch",
    "ScheduledChunk",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
]
