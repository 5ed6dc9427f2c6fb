"""What a request may name (SPEC §4, issue 35): the models the operator serves, by id, never a
path of the server's disk. The embedded ids, the ids configured at `uniun-ray up --model
ID=PATH` / `start(models=...)`, the active chat model, and cached Hugging Face repo ids only
with the operator's switch (`--hub-models`). In-process callers (the client API, the engine)
are trusted and still resolve a path. No Ray here: the app runs in-process with the
scheduler's answer (`served_models`) and the device's `aprepare` stood in for."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from uniun_ray.models import registry


@pytest.fixture
def weights(tmp_path):
    """A folder that looks like Hugging Face weights (what a probe of the disk would find)."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.fixture
def app(monkeypatch):
    """The app with a scheduler serving `served["ids"]` (hub ids when `served["hub"]`), and a
    device that says every model it is asked about is still being prepared: a request that
    passes the check gets 503 model_not_ready, one that does not gets 404 before any look."""
    import uniun_ray
    from uniun_ray.http import app as app_module

    served = {"ids": ["smollm2-135m-instruct", "mine"], "hub": False}
    asked, looked = [], []

    async def served_models():
        return served

    async def not_ready(model_id=None):
        asked.append(model_id)
        return False

    def no_look(*args, **kwargs):
        looked.append(args)
        raise AssertionError("a request made the server resolve a model id itself")
    monkeypatch.setattr(app_module, "served_models", served_models, raising=False)
    monkeypatch.setattr(app_module, "_READY", set())
    monkeypatch.setattr(uniun_ray, "aprepare", not_ready, raising=False)
    monkeypatch.setattr(registry, "resolve", no_look)
    client = TestClient(app_module.create_app())
    client.served, client.asked, client.looked = served, asked, looked
    return client


def completion(client, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})


@pytest.mark.parametrize("model", ["/etc", "/", "..", "~nosuchuser", "~", "~/.ssh", "./tests", "tests/../uniun_ray",
                                   "file:///etc/passwd"])
def test_a_path_in_the_model_field_is_an_unknown_model_and_the_disk_is_not_read(app, model, weights, monkeypatch):
    monkeypatch.chdir(weights.parent)
    for name in (model, str(weights), weights.name):
        response = completion(app, name)
        assert response.status_code == 404, (name, response.status_code, response.text)
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model", error
        assert "config.json" not in error["message"] and "folder" not in error["message"], error
        assert "mine" in error["message"] and "--hub-models" in error["message"], error
    assert app.asked == [] and app.looked == []


def test_models_routes_name_ids_only_and_refuse_paths(app, weights):
    listed = [m["id"] for m in app.get("/v1/models").json()["data"]]
    assert listed[:2] == ["smollm2-135m-instruct", "mine"] and "tiny" in listed and "all-MiniLM-L6-v2" in listed
    assert not any("/" in i for i in listed)
    assert app.get("/v1/models/mine").json()["id"] == "mine"
    for path in (str(weights), "%2Fetc", "~nosuchuser", "..%2F..%2Fetc"):
        response = app.get(f"/v1/models/{path}")
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", response.text
    assert app.looked == []


def test_served_ids_pass_and_hub_ids_only_with_the_operators_switch(app, monkeypatch, weights):
    for model in ("mine", "tiny", "smollm2-135m-instruct"):
        assert completion(app, model).json()["error"]["code"] == "model_not_ready"
    assert app.asked == ["mine", "tiny", "smollm2-135m-instruct"]
    monkeypatch.setattr(registry, "_hub_snapshot", lambda repo: weights if repo == "org/cached" else None)
    assert completion(app, "org/cached").status_code == 404
    app.served["hub"] = True
    assert completion(app, "org/cached").json()["error"]["code"] == "model_not_ready"
    for model in ("org/not-cached", "/etc", "~nosuchuser"):
        assert completion(app, model).status_code == 404


def test_configured_ids_resolve_to_their_folder_and_paths_still_resolve_for_trusted_callers(weights, monkeypatch):
    from uniun_ray.runtime.launch import config_from
    from uniun_ray.settings import Settings

    monkeypatch.setattr(registry, "_CONFIGURED", {})
    config = config_from(Settings.load(flags={"chat_model": "tiny", "slots": "1"}), {"mine": str(weights)})
    assert dict(config.models) == {"mine": str(weights)} and not config.hub_models
    spec = registry.resolve("mine")
    assert spec.id == "mine" and spec.origin is registry.Origin.LOCAL and spec.source == str(weights.resolve())
    assert registry.resolve(str(weights)).origin is registry.Origin.LOCAL      # a script's own path
    with pytest.raises(registry.UnknownModel, match="not an embedded model"):
        registry.resolve("~nosuchuser")                                         # not a RuntimeError
    with pytest.raises(ValueError, match="taken"):
        config_from(Settings.load(flags={"chat_model": "tiny"}), {"tiny": str(weights)})
    with pytest.raises(registry.UnknownModel, match="config.json"):
        config_from(Settings.load(flags={"chat_model": "tiny"}), {"empty": str(weights.parent)})


def test_a_chat_model_given_as_a_folder_is_served_under_the_folders_name(weights, monkeypatch):
    from uniun_ray.runtime.launch import config_from
    from uniun_ray.settings import Settings

    monkeypatch.setattr(registry, "_CONFIGURED", {})
    config = config_from(Settings.load(flags={"chat_model": str(weights), "slots": "1"}))
    assert config.chat_model == "my-model" and dict(config.models) == {"my-model": str(weights.resolve())}
    assert config_from(Settings.load(flags={"chat_model": "mine"}), {"mine": str(weights)}).chat_model == "mine"


def test_up_takes_repeated_models_and_the_hub_switch():
    from uniun_ray.cli import _parser

    args = _parser().parse_args(["up", "--model", "a=/w/a", "--model", "b = /w/b", "--hub-models"])
    assert dict(args.model) == {"a": "/w/a", "b": "/w/b"} and args.hub_models
    defaults = _parser().parse_args(["up"])
    assert defaults.model is None and not defaults.hub_models
    with pytest.raises(SystemExit):
        _parser().parse_args(["up", "--model", "no-folder"])


# -- the schema and the server agree -------------------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
#: (route, body, valid): what schemathesis found the schema and the server to disagree on, and
#: a valid neighbour of each.
BODIES = [
    ("/v1/completions", {"prompt": ""}, False), ("/v1/completions", {"prompt": " \n\t"}, False),
    ("/v1/completions", {"prompt": ["ok", "\x1c"]}, False), ("/v1/completions", {"prompt": [" ok"]}, True),
    ("/v1/foreground", {"subject": "note-1"}, False), ("/v1/foreground", {"kind": None, "subject": "note-1"}, False),
    ("/v1/foreground", {"kind": "gana", "subject": "note-1"}, True), ("/v1/foreground", {"kind": None}, True),
    ("/v1/embeddings", {"input": [100256]}, False), ("/v1/embeddings", {"input": [[5], [100300]]}, False),
    ("/v1/embeddings", {"input": [0, 100255]}, True),
    ("/v1/chat/completions", CHAT | {"logprobs": 0}, False), ("/v1/chat/completions", CHAT | {"logprobs": 0.0}, False),
    ("/v1/chat/completions", CHAT | {"logprobs": False}, True), ("/v1/chat/completions", CHAT | {"n": True}, False),
    ("/v1/chat/completions", CHAT | {"n": 1}, True),
    ("/v1/chat/completions", CHAT | {"store": 0}, False),
    ("/v1/completions", {"prompt": "hi", "echo": 0}, False), ("/v1/completions", {"prompt": "hi", "best_of": True}, False),
    ("/v1/completions", {"prompt": "hi", "best_of": 1}, True),
]


@pytest.fixture
def no_runtime(monkeypatch):
    """The app with no runtime behind it: what passes validation is answered 503."""
    from uniun_ray.http import app as app_module
    from uniun_ray.http.errors import unavailable

    def absent():
        raise unavailable("no runtime in this test")
    for name in ("require_scheduler", "require_embedder", "require_ready"):
        monkeypatch.setattr(app_module, name, absent if name != "require_ready" else _async(absent))
    return TestClient(app_module.create_app())


def _async(function):
    async def call(*args, **kwargs):
        return function()
    return call


@pytest.mark.parametrize("route, body, valid", BODIES)
def test_the_schema_refuses_exactly_what_the_server_refuses(no_runtime, route, body, valid):
    import jsonschema

    document = no_runtime.app.openapi()
    ref = document["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = {"$ref": ref, "components": document["components"]}
    by_schema = jsonschema.Draft202012Validator(schema).is_valid(body)
    answer = no_runtime.post(route, json=body)
    assert (by_schema, answer.status_code != 400) == (valid, valid), (by_schema, answer.status_code, answer.text)
    if not valid:
        assert answer.json()["error"]["param"].split("[")[0] in {"prompt", "subject", "input", *body}, answer.text


def test_the_schemas_cl100k_bound_is_the_last_ordinary_token():
    from uniun_ray.http.app import _cl100k
    from uniun_ray.http.schemas import CL100K_LAST

    encoding = _cl100k()
    assert encoding.decode([CL100K_LAST]) and len(encoding._mergeable_ranks) == CL100K_LAST + 1
