"""`LLM`: the step loop that ties scheduler, block manager, KV cache, model and sampler.

    llm = LLM("tiny-llama")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))

One step is three lines: `batch = scheduler.schedule()`, `tokens = runner.run(batch)`,
`scheduler.postprocess(batch, tokens)`. This is the eager engine (CPU or GPU, no CUDA graphs yet);
attention goes through `PagedAttention`: a `TreeAttentionPlan` over the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeverify.engine.block_manager import BlockManager
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.model_runner import ModelRunner
from treeverify.engine.sampler import TokenLogprobs
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.scheduler import ScheduledBatch, Scheduler
from treeverify.engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class LLM:
    def __init__(
        self,
        model: str = "tiny-llama",
        *,
        num_pages: int = 512,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        chunked_prefill_size: int | None = None,
        attention_backend: str = "torch",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        from treeverify.models import load_model

        self.config, self.model, self.tokenizer = load_model(model, dtype=dtype, device=device,
                                                             seed=seed)  # fmt: skip
        self.model.eval()
        self.device = torch.device(device)
        self.block_manager = BlockManager(num_pages, page_size)
        self.cache = KVCache(num_pages, page_size, device)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill_size=chunked_prefill_size, eos_token_id=eos,
            detokenize=self.tokenizer.decode,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model, self.cache, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_chunk=min(chunked_prefill_size or max_num_batched_tokens, max_num_batched_tokens),
            attention_backend=attention_backend,
        )  # fmt: skip
        self._logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:  # fmt: skip
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = request_id if request_id is not None else f"req-{self._next_id}"
        self._next_id += 1
        seq = self.scheduler.add(Sequence(rid, ids, params or SamplingParams()))
        self._logprobs[rid] = []
        return seq

    # ---- the step loop -------------------------------------------------------------------------
    def run_batch(self, batch: ScheduledBatch) -> list[int]:
        """The model runner's tokens for the batch; logprobs kept per request."""
        tokens, infos = self.runner.run(batch)
        for seq, info in zip(batch.sampled, infos, strict=True):
            self._logprobs[seq.request_id].append(info)
        return tokens

    def step(self) -> list[Sequence]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        return self.scheduler.postprocess(batch, self.run_batch(batch))

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.scheduler.has_unfinished():
            self.step()
        return [self.output(s) for s in seqs]

    def output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text if seq.output_text is not None else self.tokenizer.decode(
            seq.output_token_ids
        )  # fmt: skip
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             text, seq.finish_reason,
                             self._logprobs.pop(seq.request_id, []))  # fmt: skip
