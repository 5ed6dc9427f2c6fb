"""Static KV rows: each decoding job owns a row of KV tensors allocated once, so a step has fixed shapes.

``PaddedRows`` re-pads and concatenates the whole batch's KV on every join and cuts it on every
leave, and its shapes change every step: on a GPU the host then spends a step's time launching
kernels and replanning attention for a GPU that waits. Here:

* ``RowStore``: per layer, keys and values of [rows, K/V heads, context, head dim], allocated
  once at load from the rows' part of the device's memory plan (``uniun_ray.memory``). A row's context is the longest
  run it can hold (prompt + new tokens; the engine refuses longer ones).
* ``rows.StaticRows`` (a ``Rows``): a joining job's prefill KV is copied into a free row; a step writes
  each row's new token at that row's own position and attends over the first ``span`` columns of
  every row, a mask hiding the columns at or past each row's length; a leaving row is copied out
  to a batch-1 ``DynamicCache`` for the prefix cache (a revoked job resumes from it). The live
  rows are kept in the first rows of the store (a leave moves the last rows into the holes: a
  copy of those rows, never of the batch), so a step of n rows runs on the store's first rows.
* ``Graphs``: one decode step of the first rows. "exact" runs n rows over the longest row's
  length; "buckets" runs the bucket of rows (1, 2, 4 ... up to the store's rows; the rows past n
  are free rows whose output is dropped) over a bucketed span, with inputs in buffers of fixed
  address, which is what a CUDA graph replays; "graphs" captures that function once per
  (bucket, span) at load, in one memory pool, and replays it (CUDA only; prefill stays outside).

Attention over a view of the store needs no gather: SDPA reads [rows, heads, span, dim] views as
they are. A dummy row for padding would need the batch's rows gathered (a copy of every live
row's KV in every layer, every step); free rows past n serve instead.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ...memory import HEADROOM_MB, HEADROOM_SHARE, MB
from .forward import Inputs

#: Rows a store holds unless its budget is too small for CONTEXT_FLOOR tokens a row: a GPU's
#: tokens per second grow to dozens of rows, a CPU's stop growing before 16 (``runner.profile``).
STORE_ROWS = {"cuda": 64, "cpu": 16}
#: Halve the rows (down to 1) while a row would hold fewer tokens than this (or the model's context).
CONTEXT_FLOOR = 2048
#: A row's context is a multiple of this (and so is every span bucket).
CONTEXT_STEP = 256

log = logging.getLogger(__name__)

STEP_MODES = ("exact", "buckets", "graphs")
#: A row holds at most this many tokens (or the model's context), whatever the budget: memory
#: for contexts beyond it is left to the prefix cache and to other models.
MAX_ROW_CONTEXT = 32768


def token_bytes(model: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes over every layer of ``model``."""
    heads, dim = kv_shape(model.config)
    return layer_count(model) * 2 * heads * dim * torch.empty((), dtype=dtype).element_size()


def kv_shape(config: Any) -> tuple[int, int]:
    """K/V heads and head dim of a decoder's attention."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, dim


def layer_count(model: Any) -> int:
    return len(DynamicCache(config=model.config).layers)


def gpu_spare(device: torch.device, reserved_bytes: int) -> int:
    """What a GPU can give the store now (the weights loaded): its free memory less
    ``reserved_bytes`` (the prefix cache's budget) and the plan's headroom (``memory``). The
    plan's rows are capped by it: other programs may hold some of the device."""
    torch.cuda.empty_cache()       # what the load's probe left in torch's cache is free memory too
    free, _ = torch.cuda.mem_get_info(device)
    spare = free - reserved_bytes
    return max(0, int(min(spare * (1 - HEADROOM_SHARE), spare - HEADROOM_MB * MB)))


def store_shape(model: Any, dtype: torch.dtype, budget: int, rows: int, longest: int) -> tuple[int, int]:
    """(rows, context) for a store of ``budget`` bytes: up to ``rows`` rows, each of at most
    ``longest`` tokens (the model's context; MAX_ROW_CONTEXT at most), halving the rows while a row would hold less than
    CONTEXT_FLOOR (or ``longest``). (0, 0) when not even one row of CONTEXT_STEP tokens fits."""
    per_token, longest = token_bytes(model, dtype), min(longest, MAX_ROW_CONTEXT)
    while True:
        context = min(longest, budget // (rows * per_token)) // CONTEXT_STEP * CONTEXT_STEP
        if context >= min(longest, CONTEXT_FLOOR) or rows == 1:
            break
        rows //= 2
    if context < min(longest, CONTEXT_STEP):
        return 0, 0
    return rows, context


def buckets(rows: int) -> list[int]:
    """Batch sizes a fixed-shape step runs at: powers of two below ``rows``, then ``rows``."""
    sizes, size = [], 1
    while size < rows:
        sizes.append(size)
        size *= 2
    return sizes + [rows]


def spans(context: int) -> list[int]:
    """Columns a fixed-shape step attends over: doubling from CONTEXT_STEP, then ``context``."""
    sizes, size = [], CONTEXT_STEP
    while size < context:
        sizes.append(size)
        size *= 2
    return sizes + [context]


def at_least(sizes: list[int], needed: int) -> int:
    return next(size for size in sizes if size >= needed)


class RowStore:
    """The KV rows of one loaded model: per layer keys and values [rows, heads, context, dim],
    zeroed once (a masked column must hold a finite value: zero weight times NaN is NaN), and
    the decode steps over them. One ``StaticRows`` holds it at a time (``claim``/``release``)."""

    def __init__(self, runner: Any, device: torch.device, rows: int, context: int, mode: str = "exact") -> None:
        """``runner``: a ``forward.Runner`` (the model and how its forward pass is called)."""
        if mode not in STEP_MODES:
            raise ValueError(f"step mode {mode!r}; use one of {', '.join(STEP_MODES)}")
        if mode == "graphs" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; 'buckets' runs the same steps without them")
        model = runner.model
        dtype = next(model.parameters()).dtype
        heads, dim = kv_shape(model.config)
        shape = (rows, heads, context, dim)
        self.rows, self.context, self.device, self.mode = rows, context, device, mode
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_count(model))]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_count(model))]
        self.bytes = 2 * sum(tensor.numel() * tensor.element_size() for tensor in self.keys)
        self._held = False
        self._lock = threading.Lock()
        self.graphs = Graphs(runner, self)

    def claim(self) -> bool:
        """Hold the store for one ``StaticRows``; False if another holds it."""
        with self._lock:
            if self._held:
                return False
            self._held = True
            return True

    def release(self) -> None:
        with self._lock:
            self._held = False

    def free(self) -> None:
        """Let the rows' memory and the graphs go now (the model is unloaded; a batch that still
        holds the store cannot step again: the engine admits no run of an unloaded model)."""
        self.keys, self.values, self.graphs = [], [], None

    def describe(self) -> dict:
        return {"kind": "static", "rows": self.rows, "context": self.context, "mb": round(self.bytes / 2**20, 1),
                "steps": self.mode} | self.graphs.describe()


class _RowLayer(CacheLayerMixin):
    """One layer's rows in a step: the new token of row i goes to column ``positions[i]`` of the
    store's row i; attention reads the first ``span`` columns of the step's rows."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, span: int) -> None:
        super().__init__()
        self.keys, self.values, self._index, self._span = keys, values, index, span
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.scatter_(2, self._index, key_states)
        self.values.scatter_(2, self._index, value_states)
        return self.keys[:, :, : self._span], self.values[:, :, : self._span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._span, 0

    def get_seq_length(self) -> int:
        return self._span

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class Graphs:
    """The decode steps over a store's first rows (see the module's doc for the modes)."""

    def __init__(self, runner: Any, store: RowStore) -> None:
        self._runner, self._store = runner, store
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._pool: Any = None
        self.capture_s = 0.0
        self.capture_bytes = 0
        self.capture_error: str | None = None
        if store.mode == "graphs":
            self._capture_or_not()

    def describe(self) -> dict:
        if self._store.mode == "exact":
            return {}
        return {"buckets": buckets(self._store.rows), "spans": spans(self._store.context),
                "graphs": sum(buffers.graph is not None for buffers in self._buffers.values()),
                "capture_s": round(self.capture_s, 3), "capture_mb": round(self.capture_bytes / 2**20, 1)} \
            | ({"capture_error": self.capture_error} if self.capture_error else {})

    def _capture_or_not(self) -> None:
        """Capture, or, where this model's step cannot be captured (an op that syncs with the
        host, a kernel that refuses capture), run the same fixed-shape steps without graphs
        from now on, saying why in ``describe``: slower, never wrong."""
        try:
            self._capture()
        except Exception as error:  # noqa: BLE001 (any refusal: the steps run uncaptured)
            log.warning("decode steps run without CUDA graphs: capture failed: %r", error)
            self.capture_error = repr(error)
            self._store.mode = "buckets"
            for buffers in self._buffers.values():
                buffers.graph = None

    def run(self, inputs: Inputs) -> torch.Tensor:
        """Logits [rows, vocabulary] of one step of the store's first rows (as many as
        ``inputs`` feeds), row i feeding ``inputs.tokens[i]`` at column ``inputs.positions[i]``."""
        rows = len(inputs.tokens)
        if self._store.mode == "exact":
            return self._forward(inputs.tokens[:, None], inputs.positions,
                                 torch.arange(inputs.longest, device=self._store.device))
        key = (at_least(buckets(self._store.rows), rows), at_least(spans(self._store.context), inputs.longest))
        buffers = self._buffers.get(key)
        if buffers is None:   # "buckets": made at first use; "graphs": every one captured at load
            buffers = self._buffers[key] = _Buffers(*key, self._store.device)
        buffers.fill(inputs)
        if buffers.graph is not None:
            buffers.graph.replay()
        else:
            buffers.logits = self._forward(buffers.ids, buffers.positions, buffers.columns)
        return buffers.logits[:rows]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The step's forward pass on fixed tensors: what a graph captures."""
        rows, store = ids.shape[0], self._store
        index = positions.view(rows, 1, 1, 1).expand(rows, store.keys[0].shape[1], 1, store.keys[0].shape[3])
        cache = Cache(layers=[_RowLayer(keys[:rows], values[:rows], index, columns.shape[0])
                              for keys, values in zip(store.keys, store.values)])
        mask = (columns[None, :] <= positions[:, None])[:, None, None, :]
        with torch.inference_mode():
            output = self._runner.model(input_ids=ids, position_ids=positions[:, None], attention_mask=mask,
                                        use_cache=True, **{self._runner.cache_arg: cache}, **self._runner.kwargs)
        return output.logits[:, -1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (bucket of rows, span) a step of the store may run at, largest first."""
        return [(rows, span) for rows in reversed(buckets(self._store.rows))
                for span in reversed(spans(self._store.context))]

    def _capture(self) -> None:
        """A graph for every (bucket, span) a row may reach, at load, largest first, all in one
        pool: a smaller graph's memory fits in what a larger one left (nano-vllm and
        transformers capture so too); none is captured while serving, which would stall every
        row. Each is run once before its capture (kernels chosen, workspaces allocated outside
        the graph), writing column 0 of rows no job holds yet."""
        store, started = self._store, time.perf_counter()
        shapes = self.shapes()
        torch.cuda.synchronize(store.device)
        before = torch.cuda.memory_reserved(store.device)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        for rows, span in shapes:
            buffers = self._buffers.setdefault((rows, span), _Buffers(rows, span, store.device))
            buffers.logits = self._forward(buffers.ids, buffers.positions, buffers.columns)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads meanwhile does not spoil this capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                buffers.logits = self._forward(buffers.ids, buffers.positions, buffers.columns)
            buffers.graph = graph
        torch.cuda.synchronize(store.device)
        self.capture_s += time.perf_counter() - started
        self.capture_bytes += torch.cuda.memory_reserved(store.device) - before


class _Buffers:
    """A fixed-shape step's inputs at fixed addresses; rows past the live ones feed token 0 at
    column 0 of their own (free) row and attend to it alone."""

    def __init__(self, rows: int, span: int, device: torch.device) -> None:
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.columns = torch.arange(span, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def fill(self, inputs: Inputs) -> None:
        """The step's inputs copied in on the device (they are there already)."""
        rows = len(inputs.tokens)
        self.ids[:rows, 0].copy_(inputs.tokens)
        self.positions[:rows].copy_(inputs.positions)
        self.ids[rows:].zero_()
        self.positions[rows:].zero_()

