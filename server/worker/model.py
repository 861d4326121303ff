"""A Llama-family decoder in plain torch: Llama, Mistral and Qwen2 share it.

RMSNorm, rotary position embeddings (Hugging Face's ``rotate_half``
convention, i.e. the two halves of each head are rotated as a pair, not
interleaved), grouped-query attention and a SwiGLU MLP. Parameter names match
Hugging Face's ``LlamaForCausalLM`` exactly, so ``load_state_dict`` of a
safetensors checkpoint works as is::

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ q/k/v .bias with attention_bias)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.norm.weight
    lm_head.weight                                      (absent when tie_word_embeddings)

Two ways to run it:

- ``model(input_ids)``: ``input_ids`` is ``[B, T]``, the result is logits
  ``[B, T, vocab]``; causal attention over positions ``0..T-1`` of each row,
  no cache, no padding. Use it for checks and one-off scoring.
- ``model.forward_step(input_ids, positions, kv)``: the engine's path. The
  tokens of every sequence in a step are flattened into one ``[N]`` tensor;
  ``kv`` (an :class:`AttentionBackend`) stores each layer's new keys/values
  and computes attention per sequence, so the model itself knows nothing of
  paging or batching.

Mistral's ``sliding_window`` is treated as full attention: exact while a
sequence is no longer than the window (4096 for Mistral 7B v0.1, none for
v0.2+), and the worker caps its context at the window to keep it so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from . import cpu_kernels
from .cpu_kernels import grouped_decode_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    """The decoder's shape, with Hugging Face ``config.json`` field names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias).
    attention_bias: bool = False
    # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not.
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None
    model_type: str = "llama"
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (SwiGLU needs silu)")

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def dim_per_head(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + completion) the worker accepts."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """From a parsed Hugging Face ``config.json`` of a Llama, Mistral or Qwen2 model."""
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in config
        ]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        if model_type == "qwen2":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = bool(config.get("attention_bias", False))
            o_proj_bias = attention_bias
        sliding_window = config.get("sliding_window")
        if model_type == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            sliding_window=sliding_window,
            model_type=model_type,
            torch_dtype=config.get("torch_dtype"),
            extra={k: v for k, v in config.items() if k not in known},
        )


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, with the config's ``rope_scaling`` applied.

    Supported scalings: none/``default``, ``linear`` and ``llama3`` (Llama 3.1's
    wavelength-banded rescaling, as in Hugging Face's
    ``_compute_llama3_parameters``). Others raise rather than compute wrong
    positions silently.
    """
    dim = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: a CPU model whose context is at most this many positions keeps its rotary cos and sin as tables
#: (``[positions, 1, head_dim]`` each, per dtype): a step's angles are then two index_selects
#: instead of ten ops, a part of every decode step. Longer contexts compute them each step.
ROPE_TABLE_POSITIONS = 8192


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Not persistent: HF checkpoints do not carry it, so state_dict keys stay HF's.
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.max_positions = config.max_position_embeddings
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def whole_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`rotary_tables` of every position ``[max_positions, 1, head_dim]``, made once, where
        they are kept (a CPU model whose context is at most ROPE_TABLE_POSITIONS); else None."""
        if self.inv_freq.device.type != "cpu" or self.max_positions > ROPE_TABLE_POSITIONS:
            return None
        table = self._tables.get(dtype)
        if table is None:
            table = self._tables[dtype] = rotary_tables(*self(torch.arange(self.max_positions), dtype))
        return table

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rotary_tables` of ``positions``, from :meth:`whole_tables` where they are kept and
        the model runs on a CPU (the same numbers: each angle is computed alike)."""
        table = self.whole_tables(dtype) if positions.device.type == "cpu" else None
        if table is None:
            return rotary_tables(*self(positions, dtype))
        try:
            return table[0].index_select(0, positions), table[1].index_select(0, positions)
        except IndexError:  # a position past the table (the plain forward of a longer input)
            return rotary_tables(*self(positions, dtype))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[*positions.shape, head_dim]``.

        Computed in float32 then cast, as Hugging Face does, so bf16 models see
        the same angles as the reference implementation.
        """
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[..., heads, head_dim]``; cos/sin: ``[..., head_dim]`` (broadcast over heads)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as :func:`apply_rotary_tables` takes them, made once a forward: ``[..., 1,
    head_dim]`` (broadcast over heads), sin's first half negated."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(-2), signed.unsqueeze(-2)


def apply_rotary_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` in three ops instead of eight (a decode step's ops cost more than
    their arithmetic): ``rotate_half(x) * sin`` is ``x.roll(half) * signed_sin``, the same
    numbers bit for bit (only signs move)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # Hugging Face's arithmetic (x * rsqrt(mean(x^2) + eps), then the weight), the same
            # numbers bit for bit, in six ops written in place where they can be: a decode step's
            # norms cost more than their arithmetic, and torch's F.rms_norm is a composite of ~15
            # ops on a CPU (casts and copies included).
            variance = torch.mean(x * x, -1, keepdim=True)
            return (x * variance.add_(self.eps).rsqrt_()).mul_(self.weight)
        # Normalise in float32 whatever the model dtype (HF's LlamaRMSNorm does too).
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class AttentionBackend(Protocol):
    """What :meth:`LlamaForCausalLM.forward_step` needs from the engine's KV cache.

    ``q``: ``[N, heads, head_dim]``; ``k``, ``v``: ``[N, kv_heads, head_dim]``,
    already rotated, for the step's flattened tokens. The backend stores k/v
    for ``layer`` and returns the attention output ``[N, heads, head_dim]``,
    each token attending causally to its own sequence only.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class _FullSequenceAttention:
    """Causal attention over whole ``[B, T]`` rows, no cache: the plain ``forward``."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch = batch
        self.length = length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.length
        qh = q.view(b, t, *q.shape[1:]).transpose(1, 2)
        kh = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        vh = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, *q.shape[1:])


class FusedLinear:
    """Several linears of one input as one: their weights (and biases) concatenated along the
    output, made on first use and again whenever one of them changed, for inference only.

    A decode step of a small model costs its ops' dispatch more than their arithmetic, so q/k/v as
    one matmul and gate/up as one save two and one ops a layer (measured ~6.5 us a layer for q/k/v,
    tiny, one thread). The modules' own parameters stay as they are (state_dict, saving and loading
    unchanged: the concatenation is a copy, in no state_dict); a weight loaded in place (its
    version counter moves), replaced (its storage moves) or cast is seen at the next call, which
    fuses again. With autograd on, the linears run apart (a copy carries no gradient); off a CPU
    too: the copy would hold those weights twice in device memory, which the KV cache wants."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._key: list[tuple[int, int]] | None = None
        self._held: list[torch.Tensor] = []
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        #: how many times the weights were concatenated (a reload fuses again: tested)
        self.fusions = 0

    def _tensors(self) -> list[torch.Tensor]:
        # _parameters, not .weight/.bias: nn.Module's __getattr__ costs more than the check
        return [t for lin in self.linears for t in lin._parameters.values() if t is not None]

    def _state(self) -> list[tuple[int, int]]:
        # Each weight's version (a copy_ into it moves it) and address (a replaced or cast tensor
        # has a new one: the tensors fused last are held, so their addresses cannot be reused):
        # ~0.9 us for three linears, where dtype and device in the key cost ~5.
        return [(t._version, t.data_ptr()) for t in self._tensors()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through every linear, concatenated along the last dimension."""
        if torch.is_grad_enabled() or not x.is_cpu:  # is_cpu: ~4x cheaper than device.type
            return torch.cat([lin(x) for lin in self.linears], -1)
        key = self._state()
        if key != self._key:
            # Made outside inference mode: a plain tensor any later no-grad forward may use.
            with torch.inference_mode(False), torch.no_grad():
                self.weight = torch.cat([lin.weight for lin in self.linears])
                biases = [lin.bias for lin in self.linears]
                self.bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
            self._key = key
            self._held = [t.detach() for t in self._tensors()]
            self.fusions += 1
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.dim_per_head
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)
        self._qk_v = [self.num_heads + self.num_kv_heads, self.num_kv_heads]
        self._q_k = [self.num_heads, self.num_kv_heads]
        #: the fused forward's: heads rotated (q's and k's), and q, k, v's head counts
        self.rotated_heads = self.num_heads + self.num_kv_heads
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: AttentionBackend,
    ) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        # split_with_sizes, not split: Tensor.split's Python wrapper cost twice the op (~3.4 us)
        qk, v = self.qkv(x).view(n, -1, d).split_with_sizes(self._qk_v, 1)
        # q and k rotated as one: the same angles, each head alike, so the same numbers.
        q, k = apply_rotary_tables(qk, cos, sin).split_with_sizes(self._q_k, 1)
        out = kv.attend(layer, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self._halves = [inner, inner]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split_with_sizes(self._halves, -1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.index, self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def kernels_out(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer after its attention, through :mod:`.cpu_kernels` (the fused forward's and a
        chunk in pieces'): ``out`` (``[N, heads * head_dim]``) projected, added to ``residual`` in
        place and normalised, then the MLP's output, which the caller adds (into the next norm)."""
        attn, norm, mlp = self.self_attn, self.post_attention_layernorm, self.mlp
        h = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
        cpu_kernels.add_rms_norm_(h, residual, norm.weight, norm.eps)
        return F.linear(cpu_kernels.silu_mul(mlp.gate_up(h)), mlp.down_proj.weight, mlp.down_proj.bias)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self._kernels_apply(x):
            return self._forward_kernels(x, positions, kv)
        cos, sin = self.rotary_emb.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv)
        return self.norm(x)

    def _kernels_apply(self, x: torch.Tensor) -> bool:
        """Whether this forward runs through :mod:`.cpu_kernels`' C: built, float32 on a CPU, no
        autograd, and no forward hook on the modules whose outputs it no longer computes apart (the
        embedding's hook has run: it is called as a module; the layers' and the final norm's would
        see none), so a hooked model (tests/test_transformers_reference.py names the first layer
        that differs) runs the plain modules."""
        if (
            not cpu_kernels.COMPILED
            or x.dtype is not torch.float32
            or not x.is_cpu
            or torch.is_grad_enabled()
            or _global_forward_hooks
            or _global_forward_pre_hooks
        ):
            return False
        for m in (self.norm, *self.layers):  # a loop, not any() of a generator: ~3x cheaper here
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        return True

    def _forward_kernels(
        self, x: torch.Tensor, positions: torch.Tensor, kv: AttentionBackend
    ) -> torch.Tensor:
        """The plain forward's arithmetic, each norm, residual add, SiLU, rotation and decode attention
        one C call (:mod:`.cpu_kernels`; the matmuls torch's): the residual stream kept apart and each
        layer's add folded into the next norm (vLLM's fused_add_rms_norm). A small model's decode step
        costs its ops' dispatch more than their arithmetic: tiny at 32 streams ~110 ops -> ~50."""
        n = x.shape[0]
        residual = x
        h = x
        layers: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        # rotated from the whole tables at the positions (two gathers fewer), where they are kept
        tables = self.rotary_emb.whole_tables(x.dtype)
        if tables is None:
            cos, sin = self.rotary_emb.tables(positions, x.dtype)
        for i, layer in enumerate(layers):
            norm = layer.input_layernorm
            if i:
                cpu_kernels.add_rms_norm_(h, residual, norm.weight, norm.eps)
            else:
                h = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
            attn = layer.self_attn
            qkv = attn.qkv(h).view(n, -1, attn.head_dim)
            if tables is not None:
                try:  # q and k, in place
                    cpu_kernels.rope_(qkv, attn.rotated_heads, tables[0], tables[1], positions)
                except ValueError:  # a position past the tables (checked before any write): gathered
                    tables = None
                    cos, sin = self.rotary_emb.tables(positions, x.dtype)
            if tables is None:
                cpu_kernels.rope_(qkv, attn.rotated_heads, cos, sin)
            q, k, v = qkv.split_with_sizes(attn.head_split, 1)
            h = layer.kernels_out(kv.attend(layer.index, q, k, v).reshape(n, -1), residual)
        if not layers:
            return cpu_kernels.rms_norm(x, self.norm.weight, self.norm.eps)
        cpu_kernels.add_rms_norm_(h, residual, self.norm.weight, self.norm.eps)
        return h


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output projection; see the module docstring for the two forwards."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models keep no lm_head parameter: their checkpoints have no such key.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids[B, T]`` -> logits ``[B, T, vocab]``; causal, positions ``0..T-1``, no cache."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).repeat(b)
        hidden = self.model(input_ids.reshape(-1), positions, _FullSequenceAttention(b, t))
        return self.logits(hidden).view(b, t, -1)

    def forward_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One engine step over flattened tokens ``input_ids[N]`` at ``positions[N]``.

        Returns logits ``[len(logit_rows), vocab]`` for the rows asked for (the
        last token of each sequence; all rows when ``None``), so a long
        prefill does not pay for a ``[T, vocab]`` projection it throws away.
        """
        hidden = self.model(input_ids, positions, kv)
        if logit_rows is not None:
            hidden = hidden.index_select(0, logit_rows)
        return self.logits(hidden)


__all__ = [
    "ROPE_TABLE_POSITIONS",
    "SUPPORTED_MODEL_TYPES",
    "AttentionBackend",
    "FusedLinear",
    "LlamaForCausalLM",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "apply_rotary_tables",
    "grouped_decode_attention",
    "rope_inverse_frequencies",
    "rotary_tables",
    "rotate_half",
]
