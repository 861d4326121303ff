"""Loading Hugging Face checkpoints: Llama, Mistral and Qwen2 built here, in temp dirs.

Each checkpoint is written the way ``save_pretrained`` lays it out: config.json
with each family's own field names, safetensors weights, a tokenizer.json
trained here with the ``tokenizers`` library (byte-level BPE for Llama 3 and
Qwen2, SentencePiece-style BPE with byte fallback for Mistral) and a
tokenizer_config.json carrying the family's chat template. The loaded model's
logits are checked against :func:`reference_logits`, a float64 forward pass
written here from the weights dict alone, sharing no code with
``server/worker/model.py``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
import torch.nn.functional as F
from helpers import free_port
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from server.worker.chat_template import ChatTemplate, ChatTemplateError, select_template_source
from server.worker.hf import (
    CheckpointError,
    find_weight_files,
    load_model_dir,
    load_tokenizer,
    parse_dtype,
    read_config,
)
from server.worker.tokenizer import IncrementalDetokenizer
from server.worker.tokenizer import Tokenizer as TokenizerProtocol

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "café au lait, crème brûlée and a naïve façade",
    "numbers 12345 and 67890, then more words to merge",
    "streaming tokens one at a time, never half a character",
] * 4

# ---------------------------------------------------------------- chat templates

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.1's template, verbatim.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Qwen2's ChatML template with a tools block, laid out over lines the way the
# Qwen2.5 template is but without "-" whitespace control, so the output is
# right only under transformers' trim_blocks + lstrip_blocks.
QWEN2_TEMPLATE = """{% if tools %}
<|im_start|>system
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% endif %}
{% for message in messages %}
    {% if loop.first and messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


# ---------------------------------------------------------------- tokenizers


def train_byte_level(special_tokens: list[str]) -> Tokenizer:
    """A GPT-2/Llama 3/Qwen2-style byte-level BPE."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_sentencepiece_style() -> Tokenizer:
    """A Llama 2/Mistral-style BPE: ``▁`` for spaces and ``<0xNN>`` byte-fallback
    pieces for characters outside the vocabulary, as the converted
    SentencePiece tokenizer.json files of those models are."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(data))


LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def trained_tokenizers() -> dict[str, str]:
    """tokenizer.json text per family, trained once for the module."""
    llama = train_byte_level(LLAMA3_SPECIALS)
    bos = LLAMA3_SPECIALS[0]
    llama.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, llama.token_to_id(bos))]
    )
    # The Mistral tokenizer.json has no post-processor here: BOS must come from
    # tokenizer_config.json's add_bos_token, as LlamaTokenizerFast applies it.
    return {
        "llama": llama.to_str(),
        "mistral": train_sentencepiece_style().to_str(),
        "qwen2": train_byte_level(QWEN2_SPECIALS).to_str(),
    }


# ---------------------------------------------------------------- checkpoints

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama 3 layout: GQA 4:2, untied, rope_theta 500000, float32 weights.
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 4,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 80,
        "max_position_embeddings": 256,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.44.0",
        "use_cache": True,
        "vocab_size": 320,
    },
    # Mistral layout: one KV head, head_dim 16 with hidden 48 (so q_proj is
    # 64 wide, not 48), bfloat16 weights, no sliding window (v0.2+).
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 48,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0",
        "use_cache": True,
        "vocab_size": 384,
    },
    # Qwen2-0.5B layout: q/k/v biases, tied embeddings, bfloat16 weights.
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 320,
    },
}

TOKENIZER_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": LLAMA3_TEMPLATE,
    },
    "mistral": {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {
            "content": "<s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "special": True,
        },
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "legacy": True,
        "tokenizer_class": "LlamaTokenizer",
        "chat_template": MISTRAL_TEMPLATE,
    },
    "qwen2": {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": QWEN2_TEMPLATE,
    },
}

GENERATION_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"bos_token_id": 0, "eos_token_id": [1, 4], "do_sample": True, "temperature": 0.6, "top_p": 0.9},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"bos_token_id": 0, "eos_token_id": [2, 0], "do_sample": True, "repetition_penalty": 1.1},
}

FAMILIES = tuple(FAMILY_CONFIGS)


def head_dim_of(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def make_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, float32.

    Norm gains and biases are far from their init values so that a loader
    that dropped them would be caught; q/k are scaled up so attention is
    sharp and positions (hence RoPE) change the logits visibly.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        head_dim_of(config),
    )
    qkv_bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    weights = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        attn = prefix + "self_attn."
        weights[attn + "q_proj.weight"] = randn(heads * head_dim, hidden, scale=2.5 * hidden**-0.5)
        weights[attn + "k_proj.weight"] = randn(kv_heads * head_dim, hidden, scale=2.5 * hidden**-0.5)
        weights[attn + "v_proj.weight"] = randn(kv_heads * head_dim, hidden, scale=hidden**-0.5)
        weights[attn + "o_proj.weight"] = randn(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5)
        if qkv_bias:
            weights[attn + "q_proj.bias"] = randn(heads * head_dim, scale=0.3)
            weights[attn + "k_proj.bias"] = randn(kv_heads * head_dim, scale=0.3)
            weights[attn + "v_proj.bias"] = randn(kv_heads * head_dim, scale=0.3)
        weights[prefix + "mlp.gate_proj.weight"] = randn(inner, hidden, scale=hidden**-0.5)
        weights[prefix + "mlp.up_proj.weight"] = randn(inner, hidden, scale=hidden**-0.5)
        weights[prefix + "mlp.down_proj.weight"] = randn(hidden, inner, scale=inner**-0.5)
        weights[prefix + "input_layernorm.weight"] = 1.0 + randn(hidden, scale=0.3)
        weights[prefix + "post_attention_layernorm.weight"] = 1.0 + randn(hidden, scale=0.3)
    weights["model.norm.weight"] = 1.0 + randn(hidden, scale=0.3)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = randn(vocab, hidden, scale=hidden**-0.5)
    return weights


def save_weights(
    directory: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype, shards: int = 1
) -> None:
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in weights.items()}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class Checkpoint:
    def __init__(self, path: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        self.path = path
        self.config = config
        self.weights = weights  # as stored (already rounded to the file's dtype), float32


@pytest.fixture
def write_checkpoint(tmp_path: Path, trained_tokenizers: dict[str, str]) -> Callable[..., Checkpoint]:
    counter = iter(range(1000))

    def write(
        family: str,
        *,
        shards: int = 1,
        config_overrides: dict[str, Any] | None = None,
        tokenizer_overrides: dict[str, Any] | None = None,
        edit_weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
        seed: int = 0,
    ) -> Checkpoint:
        directory = tmp_path / f"{family}-{next(counter)}"
        directory.mkdir()
        config = {**FAMILY_CONFIGS[family], **(config_overrides or {})}
        weights = make_weights(config, seed)
        if edit_weights is not None:
            edit_weights(weights)
        dtype = parse_dtype(config.get("torch_dtype")) or torch.float32
        save_weights(directory, weights, dtype, shards)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIGS[family]))
        (directory / "tokenizer.json").write_text(trained_tokenizers[family])
        tokenizer_config = {**TOKENIZER_CONFIGS[family], **(tokenizer_overrides or {})}
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        stored = {name: tensor.to(dtype).float() for name, tensor in weights.items()}
        return Checkpoint(directory, config, stored)

    return write


# ---------------------------------------------------------------- the independent forward


def default_inverse_frequencies(config: dict[str, Any]) -> torch.Tensor:
    head_dim = head_dim_of(config)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (config["rope_theta"] ** exponents)


def reference_logits(
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    input_ids: torch.Tensor,
    inverse_frequencies: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` by the textbook Llama forward, in float64.

    RMSNorm, rotary embeddings in Hugging Face's half-split (``rotate_half``)
    layout, grouped-query attention by repeating each KV head for its group
    of query heads, an explicit causal mask, a SwiGLU MLP.
    """
    w = {name: tensor.to(torch.float64) for name, tensor in weights.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, eps = head_dim_of(config), config["rms_norm_eps"]
    batch, length = input_ids.shape
    inv_freq = default_inverse_frequencies(config) if inverse_frequencies is None else inverse_frequencies
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)

    def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return gain * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    causal = torch.ones(length, length, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][input_ids]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        h = rms_norm(x, w[prefix + "input_layernorm.weight"])
        q = linear(h, prefix + "self_attn.q_proj").view(batch, length, heads, head_dim).transpose(1, 2)
        k = linear(h, prefix + "self_attn.k_proj").view(batch, length, kv_heads, head_dim).transpose(1, 2)
        v = linear(h, prefix + "self_attn.v_proj").view(batch, length, kv_heads, head_dim).transpose(1, 2)
        q, k = rotate(q), rotate(k)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        attention = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        merged = attention.transpose(1, 2).reshape(batch, length, heads * head_dim)
        x = x + linear(merged, prefix + "self_attn.o_proj")
        h = rms_norm(x, w[prefix + "post_attention_layernorm.weight"])
        gated = F.silu(linear(h, prefix + "mlp.gate_proj")) * linear(h, prefix + "mlp.up_proj")
        x = x + linear(gated, prefix + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def sample_ids(config: dict[str, Any], length: int = 11) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, config["vocab_size"], (2, length), generator=generator)


def loaded_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).to(torch.float64)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_matches_the_independent_forward(family, write_checkpoint):
    checkpoint = write_checkpoint(family)
    config, model, tokenizer = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)
    # The tolerance is far below what a wrong rope_theta would cost.
    wrong_theta = {**checkpoint.config, "rope_theta": 10000.0}
    assert (reference_logits(checkpoint.weights, wrong_theta, ids) - expected).abs().max() > 1e-2
    assert config.model_type == family
    assert tokenizer.vocab_size == checkpoint.config["vocab_size"]


def test_family_specifics_reach_the_model(write_checkpoint):
    qwen = load_model_dir(write_checkpoint("qwen2").path)
    assert qwen[0].attention_bias and not qwen[0].o_proj_bias
    assert qwen[0].tie_word_embeddings and "lm_head.weight" not in qwen[1].state_dict()
    mistral = load_model_dir(write_checkpoint("mistral").path)
    assert mistral[0].head_dim == 16 and mistral[0].num_key_value_heads == 1
    # Weights stored as bfloat16 are computed in float32 on CPU.
    assert all(p.dtype == torch.float32 for p in mistral[1].parameters())


def test_mistral_without_sliding_window_field_gets_transformers_default(write_checkpoint):
    config = dict(FAMILY_CONFIGS["mistral"])
    del config["sliding_window"]
    checkpoint = write_checkpoint("mistral")
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    model_config, _, _ = load_model_dir(checkpoint.path)
    assert model_config.sliding_window == 4096
    assert model_config.max_context == 4096


def test_qwen2_sliding_window_caps_the_context_only_when_enabled(write_checkpoint):
    off, _, _ = load_model_dir(write_checkpoint("qwen2", config_overrides={"sliding_window": 64}).path)
    assert off.max_context == 32768
    overrides = {"sliding_window": 64, "use_sliding_window": True}
    on, _, _ = load_model_dir(write_checkpoint("qwen2", config_overrides=overrides).path)
    assert on.max_context == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loads_onto_cuda_in_the_checkpoint_dtype(write_checkpoint):
    checkpoint = write_checkpoint("qwen2")
    _, model, _ = load_model_dir(checkpoint.path, device="cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    error = (loaded_logits(model, ids.cuda()).cpu() - expected).abs().max().item()
    assert error < 0.1 * expected.abs().max().item()


def test_dtype_override_keeps_rotary_frequencies_in_float32(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    _, model, _ = load_model_dir(checkpoint.path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    error = (loaded_logits(model, ids) - expected).abs().max().item()
    assert error < 0.1 * expected.abs().max().item()


def test_torch_initialisers_are_restored_after_loading(write_checkpoint):
    # The loader switches random initialisation off while it builds the model.
    original = torch.nn.init.kaiming_uniform_
    load_model_dir(write_checkpoint("llama").path)
    with pytest.raises(CheckpointError):
        load_model_dir(write_checkpoint("llama", config_overrides={"model_type": "gpt2"}).path)
    assert torch.nn.init.kaiming_uniform_ is original
    assert torch.nn.Linear(4, 4).weight.abs().sum() > 0


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        parse_dtype("int8")


def test_linear_rope_scaling_divides_the_positions(write_checkpoint):
    checkpoint = write_checkpoint(
        "llama", config_overrides={"rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(
        checkpoint.weights, checkpoint.config, ids, default_inverse_frequencies(checkpoint.config) / 4.0
    )
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


def llama3_scaled_frequencies(config: dict[str, Any], scaling: dict[str, float]) -> torch.Tensor:
    # Meta's reference (llama-models, ``apply_scaling``), frequency by frequency.
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    scaled = []
    for freq in default_inverse_frequencies(config).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            scaled.append(freq)
        elif wavelen > low_wavelen:
            scaled.append(freq / scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            scaled.append((1 - smooth) * freq / scaling["factor"] + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float64)


def test_llama3_rope_scaling_matches_metas_formula(write_checkpoint):
    # With head_dim 8 and theta 500000 the wavelengths are 6.3, 167, 4.4e3, 1.2e5:
    # an original context of 64 with factors 1 and 4 puts one frequency in
    # each band (kept, smoothed, divided).
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    checkpoint = write_checkpoint("llama", config_overrides={"rope_scaling": scaling})
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    frequencies = llama3_scaled_frequencies(checkpoint.config, scaling)
    unscaled = default_inverse_frequencies(checkpoint.config)
    assert (frequencies == unscaled).any() and (frequencies == unscaled / 8).any()
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids, frequencies)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


def test_new_style_rope_parameters_are_read(write_checkpoint):
    # transformers >= 4.56 nests rope_theta in rope_parameters.
    config = dict(FAMILY_CONFIGS["qwen2"])
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    checkpoint = write_checkpoint("qwen2", config_overrides=config)
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    reference_config = {**checkpoint.config, "rope_theta": 1000000.0}
    expected = reference_logits(checkpoint.weights, reference_config, ids)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "RoPE scaling type 'yarn' is not supported"),
        ({"type": "dynamic", "factor": 2.0}, "RoPE scaling type 'dynamic' is not supported"),
        ({"rope_type": "linear"}, "'linear' RoPE scaling needs 'factor'"),
        ({"rope_type": "linear", "factor": -1}, "'rope_scaling.factor' must be a positive number"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            "needs 'original_max_position_embeddings'",
        ),
        ("linear", "'rope_scaling' must be an object or null"),
    ],
)
def test_unsupported_or_incomplete_rope_scaling_is_refused(write_checkpoint, scaling, message):
    checkpoint = write_checkpoint("llama", config_overrides={"rope_scaling": scaling})
    with pytest.raises(CheckpointError, match=message) as caught:
        load_model_dir(checkpoint.path)
    assert caught.value.field is not None and caught.value.field.startswith("rope_scaling")


# ---------------------------------------------------------------- weights files


def test_sharded_checkpoint_loads_like_a_single_file(write_checkpoint):
    single = write_checkpoint("llama")
    sharded = write_checkpoint("llama", shards=3)
    assert len(set(find_weight_files(sharded.path).values())) == 3
    ids = sample_ids(single.config)
    _, single_model, _ = load_model_dir(single.path)
    _, sharded_model, _ = load_model_dir(sharded.path)
    assert torch.equal(loaded_logits(single_model, ids), loaded_logits(sharded_model, ids))
    expected = reference_logits(sharded.weights, sharded.config, ids)
    torch.testing.assert_close(loaded_logits(sharded_model, ids), expected, atol=2e-5, rtol=1e-4)


def test_missing_shard_is_named(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", shards=2)
    (checkpoint.path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=re.escape("shard 'model-00002-of-00002.safetensors' listed in weight_map")
    ):
        load_model_dir(checkpoint.path)


def test_index_that_disagrees_with_its_shards_is_refused(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", shards=2)
    index_path = checkpoint.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = next(
        name for name in set(index["weight_map"].values()) if name != index["weight_map"]["model.norm.weight"]
    )
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map disagrees .* model\.norm\.weight"):
        load_model_dir(checkpoint.path)


def test_shard_name_escaping_the_directory_is_refused(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", shards=2)
    index_path = checkpoint.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a plain file name"):
        load_model_dir(checkpoint.path)


def test_tensor_in_two_files_is_refused(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    save_file({"model.norm.weight": torch.ones(32)}, str(checkpoint.path / "extra.safetensors"))
    (checkpoint.path / "model.safetensors").rename(checkpoint.path / "base.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("'model.norm.weight' also appears in")):
        load_model_dir(checkpoint.path)


def test_pickle_weights_are_not_loaded(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    (checkpoint.path / "model.safetensors").rename(checkpoint.path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights found .*pickle"):
        load_model_dir(checkpoint.path)


def test_corrupt_safetensors_file_is_named(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    (checkpoint.path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(
        CheckpointError, match=re.escape("model.safetensors: not a readable safetensors file")
    ):
        load_model_dir(checkpoint.path)


def test_tied_checkpoint_with_a_redundant_lm_head_loads(write_checkpoint):
    # Some exports of tied models still write lm_head.weight (a copy of the
    # embedding); transformers ignores it, and so does the loader.
    def add_head(weights):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()

    checkpoint = write_checkpoint("qwen2", edit_weights=add_head)
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


def test_untied_checkpoint_without_lm_head_names_it(write_checkpoint):
    def drop_head(weights):
        del weights["lm_head.weight"]

    checkpoint = write_checkpoint("llama", edit_weights=drop_head)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): lm_head\.weight"):
        load_model_dir(checkpoint.path)


def test_missing_and_unexpected_tensors_are_listed(write_checkpoint):
    def damage(weights):
        del weights["model.layers.1.mlp.up_proj.weight"]
        del weights["model.layers.0.input_layernorm.weight"]
        weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)

    checkpoint = write_checkpoint("llama", edit_weights=damage)
    with pytest.raises(CheckpointError) as caught:
        load_model_dir(checkpoint.path)
    message = str(caught.value)
    assert (
        "missing 2 tensor(s): model.layers.0.input_layernorm.weight, model.layers.1.mlp.up_proj.weight"
        in message
    )
    assert "unexpected 1 tensor(s): model.layers.0.self_attn.o_proj.bias" in message


def test_qwen2_without_qkv_biases_is_missing_them(write_checkpoint):
    def drop_biases(weights):
        for name in [n for n in weights if n.endswith("_proj.bias")]:
            del weights[name]

    checkpoint = write_checkpoint("qwen2", edit_weights=drop_biases)
    with pytest.raises(
        CheckpointError, match=r"missing 6 tensor\(s\): model\.layers\.0\.self_attn\.k_proj\.bias"
    ):
        load_model_dir(checkpoint.path)


def test_wrong_shape_names_the_tensor_and_both_shapes(write_checkpoint):
    def reshape(weights):
        weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 79)

    checkpoint = write_checkpoint("llama", edit_weights=reshape)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.mlp\.down_proj\.weight' has shape \[32, 79\], the model expects \[32, 80\]",
    ):
        load_model_dir(checkpoint.path)


def test_integer_weights_are_refused(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    weights = {name: tensor.clone() for name, tensor in checkpoint.weights.items()}
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(80, 32, dtype=torch.int32)
    save_file(weights, str(checkpoint.path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=re.escape("'model.layers.0.mlp.up_proj.weight' is stored as I32")
    ):
        load_model_dir(checkpoint.path)


def test_quantized_checkpoint_is_refused_by_its_config(write_checkpoint):
    quantization = {"quant_method": "awq", "bits": 4, "group_size": 128}
    checkpoint = write_checkpoint("llama", config_overrides={"quantization_config": quantization})
    with pytest.raises(
        CheckpointError, match=r"quantized checkpoints are not supported \(quant_method 'awq'\)"
    ):
        load_model_dir(checkpoint.path)


def test_old_rotary_inv_freq_buffers_are_ignored(write_checkpoint):
    def add_inv_freq(weights):
        for layer in range(2):
            weights[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    checkpoint = write_checkpoint("llama", edit_weights=add_inv_freq)
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


def test_llama_attention_and_mlp_biases_load(write_checkpoint):
    # LlamaConfig's attention_bias puts a bias on o_proj too; mlp_bias on all three MLP projections.
    def add_biases(weights):
        generator = torch.Generator().manual_seed(3)
        for layer in range(2):
            prefix = f"model.layers.{layer}."
            for name, size in (
                ("self_attn.o_proj", 32),
                ("mlp.gate_proj", 80),
                ("mlp.up_proj", 80),
                ("mlp.down_proj", 32),
            ):
                weights[prefix + name + ".bias"] = torch.randn(size, generator=generator) * 0.3

    checkpoint = write_checkpoint(
        "llama", config_overrides={"attention_bias": True, "mlp_bias": True}, edit_weights=add_biases
    )
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.weights
    _, model, _ = load_model_dir(checkpoint.path)
    ids = sample_ids(checkpoint.config)
    expected = reference_logits(checkpoint.weights, checkpoint.config, ids)
    torch.testing.assert_close(loaded_logits(model, ids), expected, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (
            {"model_type": "gemma"},
            "model_type",
            "model_type 'gemma' is not supported; supported: llama, mistral, qwen2",
        ),
        ({"model_type": None}, "model_type", "model_type None is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act", "hidden_act 'gelu' is not supported"),
        (
            {"num_key_value_heads": 3},
            "num_key_value_heads",
            r"num_attention_heads \(4\) is not a multiple of",
        ),
        ({"num_hidden_layers": True}, "num_hidden_layers", "'num_hidden_layers' must be a positive integer"),
        ({"hidden_size": 30}, "head_dim", r"hidden_size \(30\) is not a multiple of num_attention_heads"),
        ({"head_dim": 7}, "head_dim", "must be even"),
        ({"rope_theta": "big"}, "rope_theta", "'rope_theta' must be a positive number"),
        ({"torch_dtype": "float8_e4m3"}, "torch_dtype", "unsupported dtype 'float8_e4m3'"),
    ],
)
def test_bad_config_fields_are_named(write_checkpoint, overrides, field, message):
    checkpoint = write_checkpoint("llama")
    (checkpoint.path / "config.json").write_text(json.dumps({**checkpoint.config, **overrides}))
    with pytest.raises(CheckpointError, match=message) as caught:
        load_model_dir(checkpoint.path)
    assert caught.value.field == field
    assert caught.value.path == checkpoint.path / "config.json"


def test_missing_required_field_is_named(write_checkpoint):
    checkpoint = write_checkpoint("mistral")
    config = dict(checkpoint.config)
    del config["intermediate_size"]
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="required field 'intermediate_size' is missing"):
        read_config(checkpoint.path)


def test_config_that_is_not_json_gives_the_byte_offset(tmp_path):
    # "é" is two bytes: the second comma is character 23 but byte 24.
    (tmp_path / "config.json").write_text('{"model_type": "llamé",, }', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON: .* \(byte 24\)"):
        read_config(tmp_path)


def test_config_that_is_not_utf8_gives_the_byte_offset(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "ll\xff"}')
    with pytest.raises(CheckpointError, match=r"not UTF-8 \(byte 18\)"):
        read_config(tmp_path)


def test_config_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object, found list"):
        read_config(tmp_path)


def test_missing_directory_and_config_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model_dir(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model_dir(tmp_path)


# ---------------------------------------------------------------- tokenizer


def test_special_tokens_and_eos_ids_come_from_all_three_files(write_checkpoint):
    llama = load_tokenizer(write_checkpoint("llama").path)
    # generation_config [end_of_text, eot] + config 4 (eot) + tokenizer_config eot, deduplicated.
    assert llama.eos_token_ids == [1, 4]
    assert llama.bos_token_id == 0
    assert llama.encode("Hello")[0] == 0  # tokenizer.json's own post-processor adds BOS
    qwen = load_tokenizer(write_checkpoint("qwen2").path)
    assert qwen.bos_token_id is None
    assert qwen.eos_token_ids == [2, 0]
    assert qwen.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_add_bos_and_add_eos_flags_drive_a_llama_class_tokenizer(write_checkpoint):
    mistral = load_tokenizer(write_checkpoint("mistral").path)
    ids = mistral.encode("Hello world")
    assert ids[0] == mistral.bos_token_id == 1 and ids[-1] != 2 and ids.count(1) == 1
    assert mistral.encode("Hello world", add_special_tokens=False) == ids[1:]
    both = load_tokenizer(write_checkpoint("mistral", tokenizer_overrides={"add_eos_token": True}).path)
    assert both.encode("Hello world") == [*ids, 2]


def test_add_bos_token_false_drops_the_bos(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("mistral", tokenizer_overrides={"add_bos_token": False}).path)
    assert tokenizer.encode("Hello world") == tokenizer.encode("Hello world", add_special_tokens=False)
    assert 1 not in tokenizer.encode("Hello world")


def test_hf_tokenizer_satisfies_the_worker_protocol(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("llama").path)
    assert isinstance(tokenizer, TokenizerProtocol)


def test_add_eos_token_that_is_not_in_the_vocabulary_is_refused(write_checkpoint):
    checkpoint = write_checkpoint(
        "mistral", tokenizer_overrides={"add_eos_token": True, "eos_token": "<eos>"}
    )
    with pytest.raises(CheckpointError, match=re.escape("eos_token '<eos>' is not in tokenizer.json")):
        load_tokenizer(checkpoint.path)


def test_rendered_chat_encodes_with_one_bos(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("llama").path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert tokenizer.encode(prompt, add_special_tokens=False).count(tokenizer.bos_token_id) == 1


def test_tokenizer_larger_than_the_embedding_is_refused(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", config_overrides={"vocab_size": 256})
    with pytest.raises(
        CheckpointError, match=r"token ids up to 299, past the model's vocab_size of 256"
    ) as caught:
        load_model_dir(checkpoint.path)
    assert caught.value.field == "vocab_size"


def test_padded_ids_are_valid_and_decode_to_nothing(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("qwen2").path, model_vocab_size=320)
    assert tokenizer.vocab_size == 320
    assert tokenizer.decode([310, 319]) == ""
    assert load_tokenizer(write_checkpoint("qwen2").path).vocab_size == 300


def test_missing_or_broken_tokenizer_json_is_named(write_checkpoint):
    checkpoint = write_checkpoint("llama")
    (checkpoint.path / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a valid tokenizers file"):
        load_model_dir(checkpoint.path)
    (checkpoint.path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        load_model_dir(checkpoint.path)


MULTIBYTE_TEXTS = [
    "café 😀 日本語 world",
    "naïve 🧑‍🚀 crème",  # a ZWJ sequence: several emoji code points, 11 bytes
    "ends mid-emoji 🎉",
]


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_detokenization_never_splits_a_character(write_checkpoint, family, text):
    tokenizer = load_tokenizer(write_checkpoint(family).path)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "the text must be split into byte-level pieces to test anything"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([token]) for token in ids]
    deltas.append(detokenizer.flush())
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    # Some token left a character half-done and so produced no text yet.
    assert "" in deltas[:-1]
    # tokenizers' own DecodeStream, an independent implementation, agrees.
    stream = decoders.DecodeStream(skip_special_tokens=True)
    streamed = "".join(filter(None, (stream.step(tokenizer.backend, token) for token in ids)))
    assert streamed == text


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_stream_cut_mid_character_flushes_a_replacement_char(write_checkpoint, family):
    tokenizer = load_tokenizer(write_checkpoint(family).path)
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji is bytes in both tokenizers, so this drops its last byte
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.push([token]) for token in cut)
    assert "\ufffd" not in streamed
    tail = detokenizer.flush()
    assert streamed + tail == tokenizer.decode(cut)
    assert tail.endswith("\ufffd")


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cé😀日\n-")), max_size=24))
def test_incremental_deltas_add_up_to_the_full_decode(sentencepiece_and_byte_level, text):
    for tokenizer in sentencepiece_and_byte_level:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer)
        streamed = "".join(detokenizer.push([token]) for token in ids) + detokenizer.flush()
        assert streamed == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def sentencepiece_and_byte_level(tmp_path_factory, trained_tokenizers):
    loaded = []
    for family in ("mistral", "qwen2"):
        directory = tmp_path_factory.mktemp(family)
        (directory / "tokenizer.json").write_text(trained_tokenizers[family])
        (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIGS[family]))
        loaded.append(load_tokenizer(directory))
    return loaded


def test_detokenizer_skips_special_tokens(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("qwen2").path)
    ids = tokenizer.encode("Hi<|im_end|>")
    assert ids[-1] == 2
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.push([token]) for token in ids) + detokenizer.flush() == "Hi"


# ---------------------------------------------------------------- chat templates


def test_llama3_template_renders_like_transformers(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("llama").path)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hi there  "}]
    assert tokenizer.has_chat_template
    assert tokenizer.apply_chat_template(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi there<|eot_id|>")


def test_mistral_template_renders_and_its_raise_exception_is_a_value_error(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("mistral").path)
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tokenizer.apply_chat_template(conversation) == "<s>[INST] Hi [/INST]Hello!</s> [INST] Bye [/INST]"
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate user/assistant"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_qwen2_template_needs_trim_and_lstrip_blocks(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("qwen2").path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen2_tools_are_rendered_by_a_json_dumps_tojson(write_checkpoint):
    # Jinja's built-in tojson would sort the keys and escape "<" as \u003c.
    tokenizer = load_tokenizer(write_checkpoint("qwen2").path)
    tools = [{"name": "météo", "parameters": {"b": 1, "a": "<x>"}}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rain?"}], tools=tools
    )
    assert prompt == (
        "<|im_start|>system\n# Tools\n"
        '{"name": "météo", "parameters": {"b": 1, "a": "<x>"}}\n'
        "<|im_end|>\n"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nRain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_content_given_as_text_parts_is_joined(write_checkpoint):
    tokenizer = load_tokenizer(write_checkpoint("qwen2").path)
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}]
    ) == tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] must be a text part"):
        tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
        )


def test_checkpoint_without_template_falls_back_to_a_role_transcript(write_checkpoint):
    checkpoint = write_checkpoint("mistral", tokenizer_overrides={"chat_template": None})
    tokenizer = load_tokenizer(checkpoint.path)
    assert not tokenizer.has_chat_template
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    )
    assert rendered == "<s>system: Be kind.\nuser: Hi\nassistant:"


def test_chat_template_jinja_file_wins_and_generation_blocks_render(write_checkpoint):
    checkpoint = write_checkpoint("qwen2")
    (checkpoint.path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    tokenizer = load_tokenizer(checkpoint.path)
    assert tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}]) == "<assistant>x"


def test_chat_template_json_file_is_read(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", tokenizer_overrides={"chat_template": None})
    (checkpoint.path / "chat_template.json").write_text(
        json.dumps({"chat_template": "[{{ messages|length }}]"})
    )
    tokenizer = load_tokenizer(checkpoint.path)
    assert tokenizer.has_chat_template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 3) == "[3]"


def test_named_template_list_picks_default(write_checkpoint):
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    checkpoint = write_checkpoint("qwen2", tokenizer_overrides={"chat_template": templates})
    assert load_tokenizer(checkpoint.path).apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_named_template_list_without_default_takes_the_first():
    templates = [{"name": "rag", "template": "RAG"}, "junk", {"name": "tool_use", "template": "TOOLS"}]
    assert select_template_source(templates) == "RAG"
    assert select_template_source(templates, name="tool_use") == "TOOLS"
    with pytest.raises(ChatTemplateError, match="not list"):
        select_template_source(["junk"])


def test_template_that_does_not_compile_fails_at_load(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", tokenizer_overrides={"chat_template": "{% for m in messages %}"})
    with pytest.raises(CheckpointError, match=r"chat template does not compile: .*endfor") as caught:
        load_model_dir(checkpoint.path)
    assert caught.value.field == "chat_template"


def test_template_of_the_wrong_type_fails_at_load(write_checkpoint):
    checkpoint = write_checkpoint("qwen2", tokenizer_overrides={"chat_template": 42})
    with pytest.raises(CheckpointError, match="chat_template must be a string or a list"):
        load_tokenizer(checkpoint.path)


def test_template_runs_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        template.render([])


def test_template_that_indexes_content_wrongly_is_a_value_error():
    template = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        template.render([{"role": "user", "content": "text"}])


# ---------------------------------------------------------------- served by a live worker


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stream_text(raw: bytes, key: Callable[[dict[str, Any]], str | None]) -> tuple[str, bool]:
    pieces, done = [], False
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        for choice in json.loads(line[len("data: ") :]).get("choices", []):
            piece = key(choice)
            if piece:
                pieces.append(piece)
    return "".join(pieces), done


@contextmanager
def serving(model_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "worker", "--model", str(model_dir), "--port", str(port)]
    argv += ["--device", "cpu", "--kv-tokens", "2048", "--torch-threads", "1"]
    repo_root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(argv, cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                stderr = process.stderr.read().decode() if process.stderr else ""
                pytest.fail(f"worker exited with {process.returncode} while starting:\n{stderr[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("worker not healthy after 60 s")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def reference_greedy(
    checkpoint: Checkpoint, prompt_ids: list[int], max_tokens: int, eos_ids: list[int]
) -> tuple[list[int], str]:
    """Greedy continuation by :func:`reference_logits`, one full forward per token."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = reference_logits(checkpoint.weights, checkpoint.config, torch.tensor([ids]))
        token = int(logits[0, -1].argmax())
        ids.append(token)
        if token in eos_ids:
            return ids[len(prompt_ids) :], "stop"
    return ids[len(prompt_ids) :], "length"


def demote_partial_characters(tokenizer_json: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Shrink the output rows of tokens that decode to no whole character
    (lone UTF-8 bytes, padding ids, special tokens), so that the random
    model's greedy text is made of characters and can be compared as text."""
    tokenizer = Tokenizer.from_str(tokenizer_json)

    def edit(weights: dict[str, torch.Tensor]) -> None:
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        for token in range(head.shape[0]):
            if tokenizer.decode([token], skip_special_tokens=True) in ("", "\ufffd"):
                head[token] *= 0.05

    return edit


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_worker_serves_a_checkpoint_with_the_reference_greedy_output(
    write_checkpoint, trained_tokenizers, family
):
    checkpoint = write_checkpoint(family, edit_weights=demote_partial_characters(trained_tokenizers[family]))
    tokenizer = load_tokenizer(checkpoint.path)
    messages = [{"role": "user", "content": "Hello world, how are you?"}]
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    chat_ids, chat_finish = reference_greedy(checkpoint, chat_prompt, 6, tokenizer.eos_token_ids)
    text_prompt = "The quick brown fox"
    completion_prompt = tokenizer.encode(text_prompt)
    completion_ids, completion_finish = reference_greedy(
        checkpoint, completion_prompt, 6, tokenizer.eos_token_ids
    )
    generated = [t for t in chat_ids if t not in tokenizer.eos_token_ids]
    with serving(checkpoint.path) as url:
        chat = {"model": checkpoint.path.name, "messages": messages, "max_tokens": 6, "temperature": 0}
        status, raw = _post(url + "/v1/chat/completions", {**chat, "logprobs": True})
        assert status == 200, raw
        body = json.loads(raw)
        assert body["usage"]["prompt_tokens"] == len(chat_prompt)
        assert body["usage"]["completion_tokens"] == len(chat_ids)
        assert body["choices"][0]["finish_reason"] == chat_finish
        # Token by token: the served tokens are the reference's.
        served_tokens = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]
        assert served_tokens == [tokenizer.decode([token]) for token in chat_ids]
        content = body["choices"][0]["message"]["content"]
        expected_text = tokenizer.decode(generated)
        assert "\ufffd" not in expected_text, "the reference output must be whole characters to compare text"
        assert content == expected_text and len(expected_text) >= 3, expected_text

        status, raw = _post(url + "/v1/chat/completions", {**chat, "stream": True})
        assert status == 200, raw
        streamed, done = _stream_text(raw, lambda choice: choice.get("delta", {}).get("content"))
        assert done and streamed == content

        completion = {"model": checkpoint.path.name, "prompt": text_prompt, "max_tokens": 6, "temperature": 0}
        status, raw = _post(url + "/v1/completions", completion)
        assert status == 200, raw
        body = json.loads(raw)
        assert body["usage"]["prompt_tokens"] == len(completion_prompt)
        expected_text = tokenizer.decode([t for t in completion_ids if t not in tokenizer.eos_token_ids])
        assert body["usage"]["completion_tokens"] == len(completion_ids)
        assert "\ufffd" not in expected_text
        assert body["choices"][0]["text"] == expected_text
        assert body["choices"][0]["finish_reason"] == completion_finish

        # The template's own refusal reaches the client as a 400 naming it.
        if family == "mistral":
            twice_user = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
            status, raw = _post(url + "/v1/chat/completions", {**chat, "messages": twice_user})
            assert status == 400
            error = json.loads(raw)["error"]
            assert "Conversation roles must alternate" in error["message"] and error["param"] == "messages"


def test_a_lone_surrogate_is_a_400_naming_the_field_not_the_tokenizers_error(write_checkpoint):
    """The Hugging Face tokenizer cannot take a lone surrogate (a \\uD800 escape with no pair):
    the worker answers 400 naming where it is, before the tokenizer sees it (issue 19, item 6)."""
    checkpoint = write_checkpoint("qwen2")
    with pytest.raises((UnicodeEncodeError, TypeError, ValueError)):
        load_tokenizer(checkpoint.path).encode("a\ud800b")
    with serving(checkpoint.path) as url:
        model = checkpoint.path.name
        for path, body, field in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
            ("/v1/completions", {"prompt": "a\udfffb"}, "prompt"),
        ):
            status, raw = _post(url + path, {"model": model, "max_tokens": 2, **body})  # json.dumps: \ud800
            assert status == 400, raw
            error = json.loads(raw)["error"]
            assert f"'{field}' holds a lone surrogate" in error["message"] and error["code"] == "invalid_unicode"
        status, raw = _post(url + "/v1/completions", {"model": model, "max_tokens": 2, "prompt": "a\U0001f600b"})
        assert status == 200, raw
