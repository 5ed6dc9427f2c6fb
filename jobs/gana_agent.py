"""Gana agent: a tool-using agent loop through the HTTP endpoint with the openai SDK, as kind
`gana` (a closed loop: the next task starts when one ends), beside a few chat turns.

    python jobs/gana_agent.py [--tasks 3] [--model ID] [--chats 2] [--chat-model ID] [--url URL --api-key KEY]
    ray job submit --working-dir . -- python jobs/gana_agent.py --tasks 2

Each task is one agent loop: the model is asked, its `tool_calls` run as local Python tools (a
clock, a sum, a notes lookup: no network), their results go back as `role: tool` messages, until
it answers without a call (or `--max-steps`). The chats run meanwhile as kind `chat` (on the
agent's model unless told otherwise), and the scheduler puts them first (T0) while the agent's
jobs wait in the fair pool.

The model: any whose chat template takes tools (Qwen2.5-Instruct, Llama-3.1-Instruct,
Mistral-7B-Instruct-v0.3), by the id the endpoint serves it under (`uniun-ray up --model
ID=PATH`, UNIUN_MODELS, or a cached Hugging Face id with `--hub-models`). No embedded model's
template takes tools, so by default it runs on SmolLM2-135M-Instruct's weights with a hermes
template (`tool_templates`; SmolLM2 speaks ChatML, the hermes template's own tokens), served as
`smollm2-hermes` (where the script starts the runtime; a running one must have it configured):
a trained chat model, so the answers after a tool's result read as answers. So small a model
seldom calls a tool unasked: its first step is forced (`tool_choice: required`), the rest are
its own. The tests run the same loop on the untrained `tiny` (`--model tiny-hermes
--force-first`), which is fast and writes valid calls only when forced.
Without `--url` the script serves the endpoint itself on a free port (and stops it at the end).

See jobs/README.md for running it under `ray job submit`.
"""
from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from common import job_parser, session

NOTES = {"ray": "Ray schedules tasks and actors on a cluster.",
         "gana": "Gana is the agent producer: it calls tools and continues.",
         "chat": "Chat turns come first: they are tier T0."}
TOOLS = [
    {"type": "function", "function": {
        "name": "clock", "description": "The current time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
                       "required": ["zone"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "note", "description": "The note kept on a topic.",
        "parameters": {"type": "object", "properties": {"topic": {"enum": sorted(NOTES)}},
                       "required": ["topic"], "additionalProperties": False}}},
]
OFFSETS = {"UTC": 0, "CET": 1, "JST": 9}
TASKS = ["What time is it in Tokyo?", "What is 17 plus 25?", "What do my notes say about gana?"]


def run_tool(name: str, arguments: str) -> str:
    """One call of a local tool; a bad call answers with its error, as an agent framework does."""
    try:
        args = json.loads(arguments)
        if name == "clock":
            now = datetime.now(timezone.utc) + timedelta(hours=OFFSETS[args["zone"]])
            return now.strftime(f"%H:%M {args['zone']}")
        if name == "add":
            return str(int(args["a"]) + int(args["b"]))
        if name == "note":
            return NOTES[args["topic"]]
        return f"error: no tool {name!r}"
    except (ValueError, KeyError, TypeError) as error:
        return f"error: {type(error).__name__}: {error}"


def agent(client, model: str, task: str, force_first: bool, max_steps: int, max_tokens: int) -> dict:
    """One agent loop; what it did."""
    messages = [{"role": "system", "content": "Answer with the tools you are given."},
                {"role": "user", "content": task}]
    calls = 0
    for step in range(max_steps):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
            tool_choice="required" if force_first and step == 0 else "auto",
            extra_body={"kind": "gana", "producer": "gana:agent"})
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"steps": step + 1, "calls": calls, "answer": message.content or ""}
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"    {call.function.name}({call.function.arguments}) -> {result}", flush=True)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            calls += 1
    return {"steps": max_steps, "calls": calls, "answer": None}


def chats(client, model: str, turns: int, ttfts: list[float]) -> None:
    """Chat turns beside the agent, streamed: each one's time to its first piece."""
    for _ in range(turns):
        started = time.perf_counter()
        for chunk in client.chat.completions.create(model=model, stream=True, max_tokens=8,
                                                    messages=[{"role": "user", "content": "Say hello."}]):
            if chunk.choices and chunk.choices[0].delta.content:
                ttfts.append(time.perf_counter() - started)
                break
        time.sleep(0.5)


#: The id the endpoint serves the default model under (HTTP names models by id, never by path).
DEFAULT_MODEL = "smollm2-hermes"


def default_models() -> dict[str, str]:
    """SmolLM2-135M-Instruct with a hermes tools template, in a folder of its own, as the operator
    would serve it (its GGUF converted once, as any embedded model's first use does)."""
    from uniun_ray.models import materialize, resolve
    from uniun_ray.models.requests.tool_templates import with_tools

    weights = materialize(resolve("smollm2-135m-instruct"))
    folder = with_tools(weights, Path(tempfile.gettempdir()) / "uniun-smollm2-hermes")
    return {DEFAULT_MODEL: str(folder)}


def serve_endpoint() -> str:
    from uniun_ray.http import deploy

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return deploy(port=port)


def main(argv: list[str] | None = None) -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--tasks", type=int, default=3, help="agent tasks, one after another (default 3)")
    parser.add_argument("--model", help="a model whose template takes tools (default: SmolLM2-135M-Instruct with "
                                         "a hermes template, its first step forced)")
    parser.add_argument("--force-first", action="store_true", help="force a call in each task's first step "
                                                                   "(always on the default model)")
    parser.add_argument("--chats", type=int, default=2, help="chat turns beside the agent (default 2)")
    parser.add_argument("--chat-model", help="the chats' model (default: the agent's, so that no swap comes "
                                             "between them; 'default' is the active chat model)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--url", help="an endpoint already serving (default: serve one here)")
    parser.add_argument("--api-key", default="none", help="its key (UNIUN_API_KEY), with --url")
    args = parser.parse_args(argv)

    from openai import OpenAI

    session(args, None if args.model else default_models())
    model = args.model or DEFAULT_MODEL
    url = args.url or serve_endpoint()
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=5, timeout=600)
    ttfts: list[float] = []
    beside = threading.Thread(target=chats, args=(client, args.chat_model or model, args.chats, ttfts), daemon=True)
    beside.start()
    calls = 0
    try:
        for number in range(args.tasks):
            task = TASKS[number % len(TASKS)]
            print(f"[{number + 1}] {task}", flush=True)
            done = agent(client, model, task, args.force_first or args.model is None, args.max_steps, args.max_tokens)
            calls += done["calls"]
            print(f"    {done['steps']} steps, {done['calls']} tool calls; answer: "
                  f"{' '.join((done['answer'] or '(none)').split())[:80]}", flush=True)
        beside.join()
    finally:
        if args.url is None:
            from ray import serve
            serve.shutdown()
    shown = ", ".join(f"{t:.2f}s" for t in ttfts) or "-"
    print(f"gana agent: {args.tasks} tasks, {calls} tool calls on {model}; chat TTFT beside it: {shown}")


if __name__ == "__main__":
    main()
