"""Model folders of named shapes with seeded random weights, for the GPU benchmark.

A decode step's speed depends on a model's shape (layers, widths, heads, vocabulary), not on
its training, and real weights of 1B and 8B models cannot travel to a lent machine (see
../shared/gpu/README.md): so `make` builds a Llama of the shape there, seeded, saves it with
the tokenizer of a real model (SmolLM2's, carried in .gpu/tok), and the engine loads the folder
as any local model. The rows of the output head for the end-of-sequence ids are zeroed: their
logit is then 0 while the largest of the others is well above it, so greedy decoding never ends
a row early, for the project and the anchor alike.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

#: Llama layer shapes; the vocabulary and special ids come from the tokenizer's folder.
SHAPES = {
    # SmolLM2-135M as it is
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    # Llama-3.2-1B's layers on SmolLM2's vocabulary
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # Llama-3.1-8B's layers on SmolLM2's vocabulary
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # a few small layers: the benchmark's own test on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
#: What the base config keeps from the tokenizer's model: its vocabulary, ids and positions.
KEPT = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
        "rope_parameters", "rms_norm_eps")
#: Files of the tokenizer's folder that are the model, not the tokenizer.
MODEL_FILES = ("config.json", "generation_config.json", "uniun-source.json")


def make(shape: str, tokenizer: Path, folder: Path, device: str, dtype: str, seed: int = 0) -> int:
    """Write a model of ``shape`` into ``folder`` (made anew); returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for file in tokenizer.iterdir():
        if file.is_file() and file.name not in MODEL_FILES and file.suffix not in (".safetensors", ".gguf"):
            shutil.copy(file, folder / file.name)
    base = json.loads((tokenizer / "config.json").read_text())
    config = LlamaConfig(**{key: base[key] for key in KEPT if key in base}, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    never_ending(model)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def parameters(shape: str, vocabulary: int) -> int:
    """The parameter count of ``shape`` on ``vocabulary`` ids, before it is made (for a plan)."""
    s = SHAPES[shape]
    h, heads, kv, d = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * s["intermediate_size"] + 2 * h
    return s["num_hidden_layers"] * layer + vocabulary * h * (1 if s["tie_word_embeddings"] else 2) + h


def never_ending(model) -> None:
    """Zero the output head's rows of the end-of-sequence ids (see the module's docstring)."""
    import torch

    eos = model.config.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    with torch.no_grad():
        for token in ids:
            model.lm_head.weight[token].zero_()
