"""`uniun-ray`: start and stop a local head, look at the scheduler, and poke it.

    uniun-ray up [--port 6379] [--auth disabled|token] [--devices N] [--slots N|auto]
                 [--engine transformers|vllm] [--chat-model ID] [--model ID=PATH]... [--hub-models]
                 [--no-http | --http-host H --http-port P] [-- more `ray start` args]
    uniun-ray down
    uniun-ray config [--json] [--chat-model ID] [--slots N|auto] [--engine E]
    uniun-ray status [--json | --watch [--interval S]]
    uniun-ray explain JOB_ID [--log PATH]
    uniun-ray chat PROMPT [--model ID]
    uniun-ray foreground KIND|none [--subject S]
    uniun-ray embed TEXT...
    uniun-ray bench [simulator bench args]

Client commands find the cluster through --address, RAY_ADDRESS, the head `up` recorded, or
the one `ray start` recorded, in that order; they never start one (that is `up`'s job).
Exit codes: 0 ok, 1 runtime error (no cluster, a failed call), 2 usage error (bad
arguments, unknown kind or model). Expected errors print one line, never a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from . import engines
from .policy import Kind
from .settings import ENGINES, Settings, parse_models, read

DEFAULT_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265


class UsageError(ValueError):
    """Bad input found after parsing (exit 2)."""


class NoCluster(ConnectionError):
    """No Ray cluster to talk to (exit 1)."""


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count (an integer >= 1)")
    return int(text)


def _model_entry(text: str) -> tuple[str, str]:
    try:
        models = parse_models(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    if len(models) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=PATH (a model id, then the folder of its weights)")
    return next(iter(models.items()))

def _fail(message: str, code: int) -> int:
    print(f"uniun-ray: error: {message}", file=sys.stderr)
    return code


# -- finding the cluster ------------------------------------------------------------------
def _connect(args) -> None:
    import ray

    import uniun_ray
    from .runtime.launch import find_cluster

    if ray.is_initialized():
        return  # an in-process caller (a notebook, the tests) keeps its own connection
    address = find_cluster(args.address)
    if address is None:
        if args.address:
            raise NoCluster(f"no Ray cluster answers at {args.address}: start one with `uniun-ray up` "
                            "(or pass another --address)")
        raise NoCluster("no running Ray cluster found: start one with `uniun-ray up` (or pass --address)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    uniun_ray.connect(address, logging_level=logging.ERROR)


# -- client commands ----------------------------------------------------------------------
def _status(args) -> int:
    import uniun_ray
    from rich.console import Console

    from .observe import statusview

    _connect(args)
    if args.json:
        print(json.dumps(uniun_ray.status(), indent=2, sort_keys=True, default=str))
    elif args.watch:
        try:
            statusview.watch(uniun_ray.status, args.interval)
        except KeyboardInterrupt:  # Ctrl-C is how a watch ends
            pass
    else:
        Console().print(statusview.render(*statusview.fetch(uniun_ray.status)))
    return 0


def _explain(args) -> int:
    """Offline: reads the log file only, so it works after the cluster is gone."""
    from .observe.explain import explain
    from .events.log import default_path, read

    path = args.log or default_path()
    if not os.path.exists(path):
        return _fail(f"no event log at {path} (pass --log PATH; `uniun-ray up` prints where it is)", 1)
    try:
        print("\n".join(explain(read(path), args.job_id)))
    except KeyError as error:
        return _fail(error.args[0], 2)
    return 0


def _chat(args) -> int:
    import uniun_ray

    _connect(args)

    async def chat():
        stream = uniun_ray.astream("chat", args.prompt, model_id=args.model, max_new_tokens=args.max_new_tokens)
        async for piece in stream:
            print(piece, end="", flush=True)
        print()
        return stream.completion

    done = asyncio.run(chat())
    ttft = "-" if done.ttft_s is None else f"{done.ttft_s:.2f}s"
    print(f"TTFT {ttft} · {done.tokens} tokens in {done.total_s:.2f}s · {done.model_id}", file=sys.stderr)
    return 0


def _foreground(args) -> int:
    import uniun_ray

    kind = None if args.kind == "none" else args.kind
    if kind is None and args.subject is not None:
        raise UsageError("--subject needs a kind (`foreground none` clears both)")
    _connect(args)
    uniun_ray.set_foreground(kind, args.subject)
    print(f"foreground: {kind or 'none'}" + (f" (subject {args.subject})" if args.subject else ""))
    return 0


def _embed(args) -> int:
    import uniun_ray

    _connect(args)
    for text, vector in zip(args.texts, uniun_ray.embed(args.texts)):
        head = ", ".join(f"{x:+.4f}" for x in vector[:args.values])
        print(f"{len(vector)} dims [{head}, …] {text!r}")
    return 0


# -- the head -----------------------------------------------------------------------------
def _up(args) -> int:
    import ray

    from .runtime.head import HeadError, HeadState, start_head, state_path
    from .runtime.launch import config_from, start
    from .client import error_text
    from .runtime.protocol import NAMESPACE

    state = HeadState.load()
    if state and state.alive():
        print(f"already up: {state.address} (dashboard {state.dashboard_url}); stop it with `uniun-ray down`")
        return 0
    HeadState.forget()  # a stale record of a head that is gone
    try:   # a bad setting is refused before the head starts, and so is an engine this host cannot run
        settings = _settings(args)
        config = config_from(settings, dict(args.model or ()), args.hub_models)
    except ValueError as error:
        raise UsageError(str(error)) from error
    engines.check(settings.engine_settings)
    os.environ["RAY_AUTH_MODE"] = args.auth  # this process must speak the head's auth mode too
    state = start_head(port=args.port, dashboard_host=args.dashboard_host, dashboard_port=args.dashboard_port,
                       auth_mode=args.auth, temp_dir=args.temp_dir, devices=args.devices, extra=args.ray_args)
    state.save()
    try:
        context = ray.init(address=state.address, namespace=NAMESPACE, logging_level=logging.ERROR,
                           log_to_driver=False)
        state.address = context.address_info.get("gcs_address") or state.address
        state.session_dir = context.address_info.get("session_dir")
        state.dashboard_url = f"http://{context.dashboard_url}" if context.dashboard_url else None
        handles = start(config, wait_ready=False, settings=settings)
        event_log = ray.get(handles.scheduler.status.remote())["event_log"]
        print(f"active chat model: {handles.chat_model}")
        state.actors = _actor_names()
        http_url = None if args.no_http else _deploy_http(args.http_host, args.http_port)   # /health: 503 meanwhile
        if settings.warm_start:
            print(f"loading {handles.chat_model} (warm start) ...", flush=True)
            ray.get(handles.scheduler.ready.remote())
    except Exception as error:
        raise HeadError(f"the head is up, but its actors could not be created ({error_text(error)}); "
                        f"stop it with `uniun-ray down`") from error
    finally:
        state.save()
        ray.shutdown()
    print(f"Ray head up at {state.address} (auth {state.auth_mode})")
    print(f"dashboard: {state.dashboard_url or 'not running'}")
    print(f"actors: {', '.join(state.actors)}")
    print(f"event log: {event_log} (`uniun-ray status --watch`, `uniun-ray explain JOB_ID`)")
    if http_url:
        key = "bearer UNIUN_API_KEY required" if settings.api_key else "no API key"
        print(f"http: {http_url}/v1 (OpenAI-compatible; {key})")
        print(f"live page: {http_url}/   health: {http_url}/health")
    if state.dashboard_url:
        print(f"jobs: ray job submit --address {state.dashboard_url} --working-dir . -- python jobs/chat.py")
    print(f"state: {state_path()}; stop with `uniun-ray down`")
    return 0


def _settings(args) -> Settings:
    """The environment's settings with the flags of `up` (or `config`) over them."""
    return Settings.load(flags={"chat_model": args.chat_model, "slots": args.slots, "engine": args.engine})


def _config(args) -> int:
    """Every setting as `up` here would read it, with where it came from (`status` shows a
    running cluster's), and the memory plan of a CPU device of this host (before any load)."""
    import psutil

    from . import memory
    from .observe import statusview

    try:
        settings = _settings(args)
        available = psutil.virtual_memory().available
        plan = memory.plan(memory.Device("cpu", available, available), settings.engine_settings)
    except ValueError as error:   # a bad value, or budgets beyond this host's memory (MemoryShort)
        raise UsageError(str(error)) from error
    if args.json:
        print(json.dumps({"settings": settings.describe(), "cpu_memory_plan": plan.describe()}, indent=2))
        return 0
    print(settings_table(settings.describe()))
    print(f"memory plan of a CPU device here: {statusview.memory_line(plan.describe())}")
    return 0


def settings_table(rows: list[dict]) -> str:
    """Settings rows (`Settings.describe`) as aligned text: variable, value, source."""
    width = max(len(row["setting"]) for row in rows)
    return "\n".join(f"{row['setting']:<{width}}  {row['value']:<24} {row['source']}"
                     + ("  (debug)" if row["debug"] else "") for row in rows)


def _deploy_http(host: str, port: int) -> str:
    """The OpenAI-compatible endpoint (SPEC §4) on Ray Serve, keyed by $UNIUN_API_KEY."""
    from .http import deploy

    if host not in ("127.0.0.1", "localhost", "::1") and not read("api_key"):
        print(f"warning: HTTP bound to {host} without UNIUN_API_KEY: anyone who reaches it can submit "
              f"work and read the scheduler's state", file=sys.stderr)
    return deploy(host, port)


def _actor_names() -> list[str]:
    """The runtime's named actors: the scheduler, a model actor per device, the embedder."""
    import ray

    from .runtime.protocol import EMBEDDER_NAME, NAMESPACE, SCHEDULER_NAME, model_actor_name
    models = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == NAMESPACE and a["name"].startswith(model_actor_name("")))
    return [SCHEDULER_NAME, *models, EMBEDDER_NAME]


def _down(args) -> int:
    from .runtime.head import HeadState, state_path, stop_head
    from .client import error_text

    state = HeadState.load()
    if state is None:
        print(f"nothing to stop: no cluster started by `uniun-ray up` (no {state_path()})")
        return 0
    if not state.alive():
        HeadState.forget()
        print(f"the head `uniun-ray up` started at {state.address} is no longer running; forgot it")
        return 0
    try:
        killed = _kill_actors(state)
    except Exception as error:  # the head goes anyway, and its actors with it
        killed = 0
        print(f"could not kill the actors first ({error_text(error)}); stopping the head", file=sys.stderr)
    stopped = stop_head(state)
    HeadState.forget()
    print(f"stopped the Ray head at {state.address}: {killed} uniun actors killed, {stopped} processes stopped")
    return 0


def _kill_actors(state) -> int:
    """Kill the named actors of namespace "uniun" (the ones up started, every model actor, and
    producers) before their head goes, so none is left mid-call against a vanishing GCS. The
    scheduler goes first: it would re-create a model actor it saw go."""
    import ray

    from .runtime.protocol import NAMESPACE, SCHEDULER_NAME

    from .runtime.launch import reachable

    os.environ["RAY_AUTH_MODE"] = state.auth_mode
    if not reachable(state.address):
        return 0
    ray.init(address=state.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        names = sorted((a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["namespace"] == NAMESPACE), key=lambda name: name != SCHEDULER_NAME)
        for name in names:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        return len(names)
    finally:
        ray.shutdown()


# -- parsing and dispatch -----------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uniun-ray", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--address", help="Ray GCS address (default: RAY_ADDRESS, the head `up` started, "
                                          "or the last `ray start`)")

    up = commands.add_parser("up", help="start a local Ray head and the scheduler, model and embedder actors")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"GCS port (default {DEFAULT_PORT})")
    up.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard bind address (default 127.0.0.1)")
    up.add_argument("--dashboard-port", type=int, default=DEFAULT_DASHBOARD_PORT,
                    help=f"dashboard port (default {DEFAULT_DASHBOARD_PORT})")
    up.add_argument("--auth", choices=("disabled", "token"), default="disabled",
                    help="RAY_AUTH_MODE of the head (default disabled; token on shared networks)")
    up.add_argument("--temp-dir", help="Ray temp dir (default Ray's, /tmp/ray)")
    up.add_argument("--devices", type=_count, default=1,
                    help="stand-in devices to declare on a machine without GPUs: a ModelActor each, "
                         "model:cpu0, model:cpu1, ... (default 1; GPUs, where there are, are the devices)")
    up.add_argument("--chat-model", help="the active chat model every client's model_id=None means: an id, or "
                    "a folder of weights, then served under the folder's name "
                    "(default: UNIUN_CHAT_MODEL, else smollm2-135m-instruct)")
    up.add_argument("--model", action="append", type=_model_entry, metavar="ID=PATH",
                    help="serve the Hugging Face weights in folder PATH as model ID (repeatable); HTTP requests "
                         "name models by id only, never by path")
    up.add_argument("--hub-models", action="store_true",
                    help="let HTTP requests name any Hugging Face repo id already in this machine's cache "
                         "(default: only the embedded ids, --model ids and the chat model)")
    up.add_argument("--slots", help="jobs each device decodes together (continuous batching): a count, or "
                    "'auto' to measure per host and model at each load (default: UNIUN_SLOTS, else auto)")
    up.add_argument("--engine", choices=ENGINES, help="what runs each device's forward passes: transformers "
                    "(the default; the embedded models) or vllm (GPU workstations; `make install-vllm` first) "
                    "(default: UNIUN_ENGINE, else transformers)")
    up.add_argument("--no-http", action="store_true", help="do not deploy the OpenAI-compatible HTTP endpoint")
    up.add_argument("--http-host", default="127.0.0.1",
                    help="HTTP bind address (default 127.0.0.1; set UNIUN_API_KEY before binding wider)")
    up.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    up.add_argument("ray_args", nargs="*", metavar="-- RAY_START_ARG", help="more `ray start` arguments, after --")
    up.set_defaults(run=_up)

    down = commands.add_parser("down", help="stop what `uniun-ray up` started, and only that")
    down.set_defaults(run=_down)

    config = commands.add_parser("config", help="every setting `up` would use here, and where it comes from")
    config.add_argument("--json", action="store_true", help="the settings as JSON")
    for flag in ("--chat-model", "--slots"):
        config.add_argument(flag, help=f"as `up {flag}`")
    config.add_argument("--engine", choices=ENGINES, help="as `up --engine`")
    config.set_defaults(run=_config)

    status = commands.add_parser("status", parents=[client], help="the scheduler's state, once or live")
    view = status.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="the raw snapshot as JSON")
    view.add_argument("--watch", action="store_true", help="a live view, redrawn until Ctrl-C")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    status.set_defaults(run=_status)

    explain = commands.add_parser("explain", help="one job's story from the event log (works offline)")
    explain.add_argument("job_id", metavar="JOB_ID")
    explain.add_argument("--log", help="the event log (default: $UNIUN_STATE_DIR or ~/.cache/uniun-ray, events.jsonl)")
    explain.set_defaults(run=_explain)

    chat = commands.add_parser("chat", parents=[client], help="send a chat prompt, stream the answer, print TTFT")
    chat.add_argument("prompt")
    chat.add_argument("--model", help="model id (default: the active chat model)")
    chat.add_argument("--max-new-tokens", type=int, default=128)
    chat.set_defaults(run=_chat)

    foreground = commands.add_parser("foreground", parents=[client], help="put a kind in front (T1), or none")
    foreground.add_argument("kind", choices=[k.value for k in Kind] + ["none"], metavar="KIND",
                            help="one of: " + ", ".join(k.value for k in Kind) + ", none")
    foreground.add_argument("--subject", help="only jobs with this subject are hoisted (e.g. a note id)")
    foreground.set_defaults(run=_foreground)

    embed = commands.add_parser("embed", parents=[client], help="embed texts; print dims and first values")
    embed.add_argument("texts", nargs="+", metavar="TEXT")
    embed.add_argument("--values", type=int, default=5, help="how many values to print (default 5)")
    embed.set_defaults(run=_embed)

    commands.add_parser("bench", add_help=False, help="the simulator benchmark (see `uniun-ray bench --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        if argv[:1] == ["bench"]:  # forwarded whole, --help included
            from .sim.bench import main as bench

            def real(*args):  # the simulator stays Ray-free: the real-runtime replay is passed in
                from .replay import main as real_vs_sim
                return real_vs_sim(*args)
            return bench(argv[1:], real=real)
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse printed the help, or the usage and the error
        return 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `uniun-ray status --json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:
        return _report(error)


def _report(error: Exception) -> int:
    """Map expected errors to one line and an exit code; let the unexpected ones raise."""
    from ray.exceptions import RayError

    from .client import error_cause, error_text
    from .runtime.head import HeadError
    from .runtime.protocol import UniunError

    cause = error_cause(error)  # a RayTaskError carries the remote exception
    if isinstance(cause, ValueError):  # bad input: unknown kind or model, prompt too long...
        return _fail(str(cause), 2)
    if isinstance(cause, (NoCluster, HeadError, engines.EngineUnavailable)):
        return _fail(str(cause), 1)
    if isinstance(error, RayError) or isinstance(cause, (UniunError, ConnectionError, TimeoutError)):
        return _fail(error_text(error), 1)
    raise error


if __name__ == "__main__":
    sys.exit(main())
