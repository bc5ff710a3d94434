"""Prometheus metrics, named in the spirit of vLLM's (``speculum:`` prefix, ``_total`` counters).

Speculation counters are labelled by method: drafts (verification steps that carried a draft),
drafted tokens, accepted drafted tokens, and accepted tokens per draft position (position ``k``
counts steps whose ``k``-th drafted token on the accepted path was accepted), so that acceptance
rate and mean accepted length can be computed in PromQL.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import GenerationResult

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
MAX_POSITION = 16  # accepted-per-position counters for positions 1..16 (longer runs count at 16)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("speculum:request_success", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("speculum:request_rejected", "Requests refused (queue full, bad input)",
                                ["reason"], registry=r)
        self.cancelled = Counter("speculum:request_cancelled", "Requests whose client went away", registry=r)
        self.prompt_tokens = Counter("speculum:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("speculum:generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("speculum:num_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("speculum:num_requests_waiting", "Requests queued", registry=r)
        self.engine_requests = Counter("speculum:engine_requests", "Requests started on each engine process",
                                       ["engine"], registry=r)
        self.prefix_hit_tokens = Counter("speculum:prefix_cache_hit_tokens",
                                         "Prompt tokens whose KV entries came from the prefix cache", registry=r)
        self.prefill_tokens = Counter("speculum:prompt_tokens_computed",
                                      "Prompt tokens whose KV entries were computed (not copied from the prefix "
                                      "cache or from another choice of the same request)", registry=r)
        self.ttft = Histogram("speculum:time_to_first_token_seconds", "Time to first token (queue included)",
                              buckets=LATENCY_BUCKETS + (20.0, 40.0), registry=r)
        self.tpot = Histogram("speculum:time_per_output_token_seconds", "Decode time per generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("speculum:e2e_request_latency_seconds", "Request latency (queue included)",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("speculum:request_queue_time_seconds", "Time spent waiting in the queue",
                                    buckets=E2E_BUCKETS, registry=r)
        self.drafts = Counter("speculum:spec_decode_num_drafts", "Verification steps with a draft",
                              ["method"], registry=r)
        self.draft_tokens = Counter("speculum:spec_decode_num_draft_tokens", "Drafted tokens verified",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter("speculum:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                       ["method"], registry=r)
        self.accepted_per_pos = Counter("speculum:spec_decode_num_accepted_tokens_per_pos",
                                        "Steps whose drafted token at this position was accepted",
                                        ["method", "position"], registry=r)
        self.forced_tokens = Counter("speculum:structured_forced_tokens",
                                     "Tokens drafted for free because the grammar forced them", ["method"],
                                     registry=r)

    def record(self, method: str, result: GenerationResult, ttft_s: float | None, queue_s: float,
               e2e_s: float) -> None:
        self.requests.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(result.new_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if result.new_tokens > 1 and ttft_s is not None:
            self.tpot.observe(max(e2e_s - ttft_s, 0.0) / (result.new_tokens - 1))
        self.e2e.observe(e2e_s)
        self.queue_time.observe(queue_s)
        for step in result.steps:
            if step.drafted == 0:
                continue
            self.drafts.labels(method).inc()
            self.draft_tokens.labels(method).inc(step.drafted)
            self.accepted_tokens.labels(method).inc(step.accepted)
            for pos in range(1, min(step.accepted, MAX_POSITION) + 1):
                self.accepted_per_pos.labels(method, str(pos)).inc()
            if step.forced:
                self.forced_tokens.labels(method).inc(step.forced)

    def render(self) -> bytes:
        return generate_latest(self.registry)
