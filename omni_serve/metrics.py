"""Prometheus metrics of one server (its own registry, so several apps can coexist)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omni_requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"],
            registry=r)
        self.latency = Histogram(
            "omni_request_latency_seconds", "Request latency by endpoint", ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r)
        self.jobs = Counter(
            "omni_jobs", "Generation jobs by kind and outcome (completed, failed, cancelled)",
            ["kind", "outcome"], registry=r)
        self.queue_depth = Gauge("omni_queue_depth", "Jobs waiting for the worker", registry=r)
        self.step_seconds = Histogram(
            "omni_denoising_step_seconds", "Time of one denoising step",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.batch_size = Histogram(
            "omni_batch_size", "Requests run together through the denoising loop",
            buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.replica_batches = Counter(
            "omni_replica_batches", "Pipeline calls run by each data-parallel replica",
            ["replica"], registry=r)
        self.prompt_encoder = Gauge(
            "omni_prompt_encoder", "The LLM prompt encoder's batcher (--prompt-encoder), per "
            "replica worker since it started: batches (backend calls), submissions, prompts",
            ["replica", "count"], registry=r)
        self.worker_restarts = Counter(
            "omni_worker_restarts", "Model worker processes restarted after dying", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
