"""The model runner: the one room that runs a model's forward passes (prefill chunks, the decode step
on padded or static rows, graph capture and replay), its attention and its step profile."""
