"""The built-in ``tiny`` model: a seeded random Llama with the byte tokenizer.

No download: the weights come from a fixed ``torch.Generator`` seed, so every
process builds the same model bit for bit (a context and a generation worker
agree on it). Small enough that the test suite runs it on 2 CPU cores in
seconds, with 4 query heads over 2 KV heads so grouped-query attention is
exercised.

Random weights make a degenerate generator (the same byte over and over), so
two things are shaped by hand, to make greedy output vary with the prompt and
stay readable, so that equality tests mean something:

- the query/key projections are scaled up, so attention is sharp and the next
  token depends on the context, not only on the last token;
- ``lm_head`` rows of printable ASCII are scaled up and those of the special
  tokens down, so greedy text is mostly printable and rarely ends early.
"""

from __future__ import annotations

import torch

from .model import LlamaForCausalLM, ModelConfig
from .tokenizer import ByteTokenizer

TINY_SEED = 20240607


def tiny_config() -> ModelConfig:
    tokenizer = ByteTokenizer()
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_ids,
        model_type="llama",
    )


def build_tiny(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, LlamaForCausalLM, ByteTokenizer]:
    config = tiny_config()
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
                continue
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            if ".q_proj." in name or ".k_proj." in name:
                std *= 2.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        lm_head = model.lm_head
        assert lm_head is not None
        printable = torch.arange(32, 127)
        lm_head.weight[printable] *= 3.0
        lm_head.weight[256:] *= 0.3
    model.to(device=device, dtype=dtype).eval()
    return config, model, ByteTokenizer()
