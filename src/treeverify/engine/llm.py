"""`LLM`: the step loop that ties scheduler, block manager, KV cache, model and sampler.

    llm = LLM("tiny-llama")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))

One step is three lines: `batch = scheduler.schedule()`, `tokens = runner.run(batch)`,
`scheduler.postprocess(batch, tokens)`. This is the eager engine (CPU or GPU, no CUDA graphs yet);
attention goes through `PagedAttention`: a `TreeAttentionPlan` over the paged cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from treeverify.engine.block_manager import BlockManager
from treeverify.engine.kv_cache import KVCache
from treeverify.engine.model_runner import ModelRunner
from treeverify.engine.sampler import TokenLogprobs, sample
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.scheduler import ScheduledBatch, Scheduler
from treeverify.engine.sequence import Sequence
from treeverify.engine.speculative import SpeculativeDecoder


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
        speculative_algorithm: str | None = None,  # "DDTREE" | "CHAIN" | None
        speculative_ddtree_budget: int = 16,  # tree nodes besides the root
        speculative_num_draft_tokens: int = 4,  # depth L
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
        budget = speculative_ddtree_budget if speculative_algorithm else 0
        chunk = min(chunked_prefill_size or max_num_batched_tokens, max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model, self.cache, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens + max_num_seqs * budget,
            max_chunk=max(chunk, budget + 1), attention_backend=attention_backend,
        )  # fmt: skip
        self.spec = None
        if speculative_algorithm:
            self.spec = SpeculativeDecoder(
                self.block_manager, self.cache, self.config.vocab_size,
                algorithm=speculative_algorithm, budget=speculative_ddtree_budget,
                depth=speculative_num_draft_tokens,
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
    def run_batch(self, batch: ScheduledBatch) -> list[int | list[int]]:
        """One forward for the batch: a token per plain sequence, a round's tokens per
        speculating one; logprobs kept per request."""
        trees = {}
        if self.spec is not None:
            for c in batch.decodes:
                if c.samples and self.spec.wants(c.seq):
                    tree = self.spec.draft(c.seq)
                    if tree is not None:
                        trees[c.seq.request_id] = tree
        t0 = time.perf_counter()
        rows = self.runner.run(batch, trees)  # per sampled sequence: (1 or T, V)
        if trees:  # the round's verify phase is this step's forward
            self.spec.stats.phase_seconds["verify"] += time.perf_counter() - t0
        plain = [i for i, s in enumerate(batch.sampled) if s.request_id not in trees]
        out: list[int | list[int]] = [0] * len(rows)
        if plain:
            toks, infos = sample(torch.cat([rows[i] for i in plain]),
                                 [batch.sampled[i] for i in plain])  # fmt: skip
            for i, tok, info in zip(plain, toks, infos, strict=True):
                out[i] = tok
                self._logprobs[batch.sampled[i].request_id].append(info)
        for i, seq in enumerate(batch.sampled):
            if seq.request_id in trees:
                out[i] = self.spec.accept(seq, trees[seq.request_id], rows[i])
        return out

    def step(self) -> list[Sequence]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        tokens = self.run_batch(batch)
        finished = self.scheduler.postprocess(batch, tokens)
        for seq, toks in zip(batch.sampled, tokens, strict=True):
            if isinstance(toks, list) and not seq.is_finished:
                seq.num_cached_tokens += len(toks) - 1  # the accepted nodes' K/V, moved in place
        return finished

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

    def logprobs_so_far(self, request_id: str) -> list[TokenLogprobs | None]:
        """Logprobs of the tokens a running request has produced so far (for streaming)."""
        return self._logprobs.get(request_id, [])

    def recover_after_failed_step(self) -> None:
        """After `step()` raised mid-batch: forget the batch so scheduling can continue."""
        self.scheduler.discard_in_flight()

    @property
    def spec_stats(self) -> dict | None:
        """Speculation counters for /server_info, or None when speculation is off."""
        if self.spec is None:
            return None
        st = self.spec.stats
        return {
            "algorithm": self.spec.algorithm,
            "budget": self.spec.budget,
            "num_draft_tokens": self.spec.depth,
            "rounds": st.rounds,
            "avg_spec_accept_length": round(st.avg_accept_length, 4),
            "accept_length_histogram": dict(sorted(st.histogram.items())),
            "phase_seconds": {k: round(v, 6) for k, v in st.phase_seconds.items()},
        }

    def output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text if seq.output_text is not None else self.tokenizer.decode(
            seq.output_token_ids
        )  # fmt: skip
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             text, seq.finish_reason,
                             self._logprobs.pop(seq.request_id, []))  # fmt: skip
