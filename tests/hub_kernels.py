"""A recorder of Hub-kernel requests, for the tests that a load asks for none (issue 35).

transformers kernelizes a model at ``from_pretrained`` unless told not to: it calls its
``kernelize`` hook, which hands the model to the ``kernels`` package, which asks the Hub for the
kernels mapped to the device (none for a CPU, ``kernels-community/rotary`` and more for CUDA).
On a CPU no request ever reaches the network, so a test that waited for a network error would
pass whatever the code did: this one replaces the hook and every way ``kernels`` reaches the
Hub with a function that records the request and raises, as an offline machine would.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

#: (module, attribute): transformers' kernelize hook as ``from_pretrained`` calls it, the
#: ``kernels`` package's own kernelize as transformers calls it, and the one function through
#: which ``kernels`` talks to the Hub, in each module that imported it by name.
ENTRY_POINTS = (
    ("transformers.modeling_utils", "kernelize"),
    ("transformers.integrations.hub_kernels", "_kernels_kernelize"),
    ("transformers.integrations.hub_kernels", "get_kernel_hub"),
    ("kernels._internals.hf_hub", "_get_hf_api"),
    ("kernels._internals.load", "_get_hf_api"),
    ("kernels._internals.layer.layer", "_get_hf_api"),
    ("kernels._internals.layer.func", "_get_hf_api"),
)


class HubKernelRequest(RuntimeError):
    """What a recorded request raises: the load fails as it would offline on CUDA."""


@contextmanager
def hub_kernel_requests() -> Iterator[list[str]]:
    """Within the block, every Hub-kernel request is appended to the list yielded, then refused.
    Without the ``kernels`` package only transformers' hook is there (it is then never called)."""
    asked: list[str] = []
    saved = []
    for module_name, attribute in ENTRY_POINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if not hasattr(module, attribute):
            continue
        saved.append((module, attribute, getattr(module, attribute)))

        def refuse(*args, _name=f"{module_name}.{attribute}", **kwargs):
            asked.append(_name)
            raise HubKernelRequest(f"a load asked for Hub kernels: {_name}")
        setattr(module, attribute, refuse)
    assert any(attribute == "kernelize" for _, attribute, _ in saved), \
        "transformers' kernelize hook moved: update tests/hub_kernels.ENTRY_POINTS"
    try:
        yield asked
    finally:
        for module, attribute, original in saved:
            setattr(module, attribute, original)
