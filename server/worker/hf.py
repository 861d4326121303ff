"""Load a local Hugging Face-format checkpoint: Llama, Mistral or Qwen2.

A checkpoint directory holds ``config.json``, the weights as ``*.safetensors``
(one file, or shards listed by ``model.safetensors.index.json``),
``tokenizer.json`` and usually ``tokenizer_config.json`` (special tokens, chat
template) and ``generation_config.json`` (end-of-sequence ids).
:func:`load_model_dir` turns it into ``(ModelConfig, LlamaForCausalLM,
HFTokenizer)``.

The loader refuses what it would get wrong rather than serving a model that
quietly computes something else: an unknown ``model_type``, a RoPE scaling
type the model does not implement, a non-SiLU activation, a quantized export,
a weight that is missing, left over, of the wrong shape or not stored as
floating point. Each refusal is a
:class:`CheckpointError` naming the file and field. Only safetensors are read:
``pytorch_model.bin`` is a pickle, and unpickling a downloaded file runs
whatever code it carries.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer, processors

from .chat_template import FALLBACK_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, select_template_source
from .model import SUPPORTED_MODEL_TYPES, LlamaForCausalLM, ModelConfig
from .tokenizer import message_text

log = logging.getLogger(__name__)

# Buffers that old Llama exports saved beside the weights; transformers skips
# them on load (``_keys_to_ignore_on_load_unexpected``) because the model
# recomputes them from rope_theta.
_IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)

# Defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config for the
# fields a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6

# safetensors' dtype codes of the floating-point types the loader casts from.
_FLOAT_STORAGE = frozenset({"F16", "BF16", "F32", "F64"})

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint directory this loader cannot serve correctly.

    ``path`` is the offending file (or the directory); ``field`` the config
    field or weight name, when one is to blame.
    """

    def __init__(self, message: str, path: Path | str | None = None, field: str | None = None) -> None:
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{message}")
        self.path = Path(path) if path is not None else None
        self.field = field


# --------------------------------------------------------------------------- config


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError("file not found", path)
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"not UTF-8 (byte {exc.start})", path) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # json reports a character index; the byte offset is what an editor or hexdump shows.
        offset = len(text[: exc.pos].encode("utf-8")) + (len(raw) - len(text.encode("utf-8")))
        raise CheckpointError(f"not valid JSON: {exc.msg} (byte {offset})", path) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"expected a JSON object, found {type(data).__name__}", path)
    return data


def _positive_int(config: Mapping[str, Any], field: str, path: Path) -> int:
    value = config.get(field)
    # bool is an int subclass; `true` as a layer count is a broken config.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        if value is None:
            raise CheckpointError(f"required field {field!r} is missing", path, field)
        raise CheckpointError(f"{field!r} must be a positive integer, got {value!r}", path, field)
    return value


def _positive_float(value: Any, field: str, path: Path) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
    ):
        raise CheckpointError(f"{field!r} must be a positive number, got {value!r}", path, field)
    return float(value)


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``torch.float32``, ``"bfloat16"``, ``"bf16"``... as a ``torch.dtype``;
    ``None`` and ``"auto"`` mean "decide from the checkpoint"."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value == "auto":
        return None
    name = value.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


_ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope_settings(config: Mapping[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` with the scaling validated.

    transformers >= 4.56 moved both into ``rope_parameters``; older exports
    have top-level ``rope_theta`` and ``rope_scaling``. The model implements
    unscaled RoPE, "linear" and "llama3" (Llama 3.1+); "dynamic", "yarn",
    "longrope" and the rest change the rotary frequencies in ways it does not
    compute, and serving them as plain RoPE would give plausible-looking
    garbage, so they are refused.
    """
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
        field = "rope_parameters"
    else:
        theta = config.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = config.get("rope_scaling")
        field = "rope_scaling"
    theta = _positive_float(theta, "rope_theta", path)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise CheckpointError(f"{field!r} must be an object or null, got {scaling!r}", path, field)
    # Older configs say "type", newer ones "rope_type".
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_SCALING_FIELDS:
        raise CheckpointError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, "
            f"{', '.join(_ROPE_SCALING_FIELDS)}); serving it as plain RoPE would produce wrong logits",
            path,
            field,
        )
    validated: dict[str, Any] = {"rope_type": rope_type}
    for name in _ROPE_SCALING_FIELDS[rope_type]:
        if name not in scaling:
            raise CheckpointError(f"{rope_type!r} RoPE scaling needs {name!r}", path, f"{field}.{name}")
        validated[name] = _positive_float(scaling[name], f"{field}.{name}", path)
    if rope_type == "llama3" and validated["low_freq_factor"] == validated["high_freq_factor"]:
        # The smoothing band divides by their difference.
        raise CheckpointError("llama3 RoPE scaling needs low_freq_factor != high_freq_factor", path, field)
    return theta, validated


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` validated and completed with the family's defaults.

    The result keeps Hugging Face field names, so it feeds
    ``ModelConfig.from_hf`` directly. Family differences are made explicit:
    Qwen2 always has q/k/v biases (its config has no ``attention_bias``
    field); Mistral's ``sliding_window`` gets transformers' default of 4096
    when absent (``ModelConfig.max_context`` caps the context at the window,
    below which sliding attention equals full causal attention).
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    raw = _read_json(path, required=True)
    assert raw is not None
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            path,
            "model_type",
        )

    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else quantization
        raise CheckpointError(
            f"quantized checkpoints are not supported (quant_method {method!r}); use unquantized weights",
            path,
            "quantization_config",
        )

    config = dict(raw)
    _complete_shape(config, path)
    _complete_numerics(config, model_type, path)
    _complete_family(config, model_type, path)
    # transformers >= 4.56 writes "dtype", older versions "torch_dtype".
    declared_dtype = config.get("torch_dtype", config.get("dtype"))
    if declared_dtype is not None:
        try:
            parse_dtype(declared_dtype)
        except ValueError as exc:
            raise CheckpointError(str(exc), path, "torch_dtype") from exc
    config["torch_dtype"] = declared_dtype
    return config


def _complete_shape(config: dict[str, Any], path: Path) -> None:
    """The layer sizes and the heads (``num_key_value_heads``, ``head_dim`` filled in when absent)."""
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        _positive_int(config, field, path)
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = heads
    kv_heads = _positive_int(config, "num_key_value_heads", path)
    if heads % kv_heads:
        raise CheckpointError(
            f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})",
            path,
            "num_key_value_heads",
        )
    if config.get("head_dim") is None:
        if config["hidden_size"] % heads:
            raise CheckpointError(
                f"hidden_size ({config['hidden_size']}) is not a multiple of num_attention_heads ({heads}) "
                "and no head_dim is given",
                path,
                "head_dim",
            )
        config["head_dim"] = config["hidden_size"] // heads
    head_dim = _positive_int(config, "head_dim", path)
    if head_dim % 2:
        raise CheckpointError(f"head_dim ({head_dim}) must be even for rotary embeddings", path, "head_dim")


def _complete_numerics(config: dict[str, Any], model_type: str, path: Path) -> None:
    """The activation, the norm's epsilon, RoPE, the positions and the tied embeddings."""
    activation = config.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise CheckpointError(
            f"hidden_act {activation!r} is not supported (the MLP is SwiGLU, which needs silu)",
            path,
            "hidden_act",
        )
    config["hidden_act"] = "silu"
    config["rms_norm_eps"] = _positive_float(
        config.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS), "rms_norm_eps", path
    )
    config["rope_theta"], config["rope_scaling"] = _rope_settings(config, path)
    config.pop("rope_parameters", None)
    if config.get("max_position_embeddings") is None:
        config["max_position_embeddings"] = _DEFAULT_MAX_POSITIONS[model_type]
    _positive_int(config, "max_position_embeddings", path)
    config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))


def _complete_family(config: dict[str, Any], model_type: str, path: Path) -> None:
    """What differs between Llama, Qwen2 and Mistral: the biases and the sliding window."""
    if model_type == "qwen2":
        # Qwen2Config has no attention_bias field: q/k/v always carry a bias
        # and o_proj never does (ModelConfig.from_hf encodes the same).
        config["attention_bias"] = True
    elif model_type == "mistral":
        config["attention_bias"] = False
        # MistralConfig's default window is 4096 when the field is absent;
        # v0.2+ checkpoints write null to switch it off. ModelConfig caps the
        # context at the window, where sliding and full attention coincide.
        config["sliding_window"] = config.get("sliding_window", 4096)
    else:
        config["attention_bias"] = bool(config.get("attention_bias", False))
        config["mlp_bias"] = bool(config.get("mlp_bias", False))
    window = config.get("sliding_window")
    max_positions = config["max_position_embeddings"]
    if window is not None and (model_type != "qwen2" or config.get("use_sliding_window")):
        _positive_int(config, "sliding_window", path)
        if window < max_positions:
            log.info(
                "%s: sliding_window %d < max_position_embeddings %d; the context is capped at %d tokens",
                path,
                window,
                max_positions,
                window,
            )


def choose_dtype(
    config: Mapping[str, Any], device: torch.device, override: str | torch.dtype | None
) -> torch.dtype:
    """The compute dtype: ``override`` if given, else the checkpoint's own on
    CUDA, and float32 on CPU, where half-precision matmuls are slow and bf16
    accumulates visibly worse than the checkpoint's authors measured on GPU."""
    chosen = parse_dtype(override)
    if chosen is not None:
        return chosen
    if device.type == "cpu":
        return torch.float32
    return parse_dtype(config.get("torch_dtype")) or torch.float32


# --------------------------------------------------------------------------- weights


def find_weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Which file holds each tensor: ``{tensor name: safetensors path}``.

    Uses ``model.safetensors.index.json`` when present (sharded exports), else
    ``model.safetensors``, else every ``*.safetensors`` in the directory. Only
    the files' headers are read.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    index = _read_json(index_path, required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError("'weight_map' must be a non-empty object", index_path, "weight_map")
        files = sorted({str(name) for name in weight_map.values()})
        for name in files:
            if Path(name).name != name:
                # A shard name with a directory part could point outside the checkpoint.
                raise CheckpointError(
                    f"shard name {name!r} is not a plain file name", index_path, "weight_map"
                )
            if not (model_dir / name).is_file():
                raise CheckpointError(
                    f"shard {name!r} listed in weight_map is missing", index_path, "weight_map"
                )
        located = _tensor_locations([model_dir / name for name in files])
        listed = {key: model_dir / str(name) for key, name in weight_map.items()}
        disagree = sorted(
            key for key in listed.keys() | located.keys() if listed.get(key) != located.get(key)
        )
        if disagree:
            raise CheckpointError(
                f"weight_map disagrees with the shards' contents for {len(disagree)} tensor(s): "
                + _abbreviate(disagree),
                index_path,
                "weight_map",
            )
        return located
    single = model_dir / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not candidates:
        hint = " (pytorch_model.bin is a pickle and is not loaded; convert it to safetensors)"
        has_bin = any(model_dir.glob("pytorch_model*.bin"))
        raise CheckpointError("no *.safetensors weights found" + (hint if has_bin else ""), model_dir)
    return _tensor_locations(candidates)


def _tensor_locations(files: Sequence[Path]) -> dict[str, Path]:
    located: dict[str, Path] = {}
    for file in files:
        for key in _safetensors_keys(file):
            if key in located:
                raise CheckpointError(f"tensor {key!r} also appears in {located[key].name}", file, key)
            located[key] = file
    return located


def _safetensors_keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"not a readable safetensors file: {exc}", file) from exc


def _abbreviate(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _is_ignored(key: str) -> bool:
    return key.endswith(_IGNORED_CHECKPOINT_SUFFIXES)


def load_weights(model: torch.nn.Module, model_dir: str | Path, *, tie_word_embeddings: bool) -> None:
    """Copy a checkpoint's tensors into ``model``, in place, strictly.

    Every parameter and persistent buffer of ``model`` must come from the
    checkpoint and every checkpoint tensor must land somewhere, with the same
    shape; otherwise a :class:`CheckpointError` lists the offenders before any
    tensor is read. With tied embeddings ``lm_head.weight`` is not expected
    (transformers ignores it when present, and so does this), and the
    embedding matrix is shared with the head after loading. Tensors are read
    one at a time (memory-mapped) and copied into the model's own tensors,
    which casts and moves them, so peak memory is the model plus one tensor.
    """
    model_dir = Path(model_dir)
    locations = find_weight_files(model_dir)
    targets = {key: value for key, value in model.state_dict(keep_vars=True).items() if not _is_ignored(key)}
    if tie_word_embeddings:
        targets.pop("lm_head.weight", None)
        locations.pop("lm_head.weight", None)
    found = {key for key in locations if not _is_ignored(key)}
    missing = sorted(targets.keys() - found)
    unexpected = sorted(found - targets.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_abbreviate(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_abbreviate(unexpected)}")
        raise CheckpointError("weights do not match the model: " + "; ".join(parts), model_dir)

    by_file: dict[Path, list[str]] = {}
    for key in sorted(found):
        by_file.setdefault(locations[key], []).append(key)
    with torch.no_grad():
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in keys:
                    target = targets[key]
                    stored = handle.get_slice(key)
                    if stored.get_dtype() not in _FLOAT_STORAGE:
                        # Packed integers (quantized exports) would be cast to
                        # floats digit for digit: a model of nonsense weights.
                        raise CheckpointError(
                            f"tensor {key!r} is stored as {stored.get_dtype()}, not a floating-point type",
                            file,
                            key,
                        )
                    shape = tuple(stored.get_shape())
                    if shape != tuple(target.shape):
                        raise CheckpointError(
                            f"tensor {key!r} has shape {list(shape)}, the model expects {list(target.shape)}",
                            file,
                            key,
                        )
                    target.copy_(handle.get_tensor(key))
        if tie_word_embeddings:
            _tie_head(model)


def _tie_head(model: torch.nn.Module) -> None:
    # LlamaForCausalLM has no lm_head when tied; a module that keeps one gets
    # the embedding matrix shared into it, as transformers' tie_weights does.
    head = getattr(model, "lm_head", None)
    embed = model.get_submodule("model.embed_tokens")
    if (
        isinstance(head, torch.nn.Linear)
        and isinstance(embed, torch.nn.Embedding)
        and head.weight is not embed.weight
    ):
        head.weight = embed.weight


# --------------------------------------------------------------------------- tokenizer


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, or an
    ``AddedToken`` object ``{"content": ..., ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` with its special tokens and chat template.

    - ``encode`` runs the tokenizer's own post-processor, so a Llama tokenizer
      prepends BOS as transformers does; ``add_bos_token``/``add_eos_token`` in
      ``tokenizer_config.json`` override it for Llama tokenizer classes, as
      ``LlamaTokenizerFast`` does. Text rendered from the chat template
      already contains BOS, so encode it with ``add_special_tokens=False``
      (transformers' ``apply_chat_template(tokenize=True)`` does the same).
    - ``eos_token_ids``: the union of ``generation_config.json``'s and
      ``config.json``'s ``eos_token_id`` and the ``eos_token`` of
      ``tokenizer_config.json``; chat models list their end-of-turn token in
      the first, base models only have the last.
    - The chat template comes from ``chat_template.jinja``, ``chat_template.json``
      or ``tokenizer_config.json``'s ``chat_template``, rendered as
      transformers does (see :mod:`.chat_template`). A checkpoint without one
      (a base model) gets :data:`.chat_template.FALLBACK_CHAT_TEMPLATE`, a
      ``role: content`` transcript ending in ``assistant:``;
      ``has_chat_template`` tells which.
    - ``decode`` skips special tokens (a chat model's end-of-turn marker is
      not part of the answer) and does not apply transformers'
      ``clean_up_tokenization_spaces`` (which glues " ." to "."), so
      :class:`.tokenizer.IncrementalDetokenizer`'s deltas add up to the full
      decode.
    - Message ``content`` given as a list of text parts (OpenAI's format) is
      joined into a string before rendering: the Llama, Mistral and Qwen2
      templates concatenate ``content`` as a string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        model_vocab_size: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.has_chat_template = chat_template is not None
        self.chat_template = ChatTemplate(chat_template or FALLBACK_CHAT_TEMPLATE, self.special_tokens)
        # The valid ids are the model's embedding rows, which are often padded
        # past the tokenizer (Qwen2: 151936 rows, ~151665 tokens); the ids in
        # between are fine model inputs and decode to "".
        self.vocab_size = model_vocab_size if model_vocab_size is not None else _id_space(tokenizer)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos) if bos is not None else None

    @property
    def backend(self) -> Tokenizer:
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The Rust side wants a list of Python ints (a tensor or numpy ints raise).
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        flattened = [
            {**message, "content": message_text(dict(message), index)}
            if isinstance(message, Mapping) and isinstance(message.get("content"), list)
            else message
            for index, message in enumerate(messages)
        ]
        if "developer" not in self.chat_template.source:
            # OpenAI's newer name for system instructions; a template that never heard of it
            # would refuse it or drop it
            flattened = [
                {**m, "role": "system"} if isinstance(m, Mapping) and m.get("role") == "developer" else m
                for m in flattened
            ]
        return self.chat_template.render(flattened, add_generation_prompt=add_generation_prompt, **kwargs)


def _id_space(tokenizer: Tokenizer) -> int:
    """One past the largest id (added tokens may sit above a gap)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def load_tokenizer(model_dir: str | Path, *, model_vocab_size: int | None = None) -> HFTokenizer:
    """The :class:`HFTokenizer` of a checkpoint directory (see its docstring
    for where each piece comes from)."""
    model_dir = Path(model_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError("file not found (only fast-tokenizer exports are supported)", tokenizer_path)
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # the Rust side raises a bare Exception on bad files
        raise CheckpointError(f"not a valid tokenizers file: {exc}", tokenizer_path) from exc

    tokenizer_config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_config_path, required=False) or {}
    generation_config = _read_json(model_dir / "generation_config.json", required=False) or {}
    model_config = _read_json(model_dir / "config.json", required=False) or {}

    special_tokens: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        text = _token_text(tokenizer_config.get(name))
        if text is not None:
            special_tokens[name] = text

    eos_ids = _ids(generation_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
    eos_text = special_tokens.get("eos_token")
    if eos_text is not None:
        eos_id = tokenizer.token_to_id(eos_text)
        if eos_id is None:
            raise CheckpointError(
                f"eos_token {eos_text!r} is not in tokenizer.json", tokenizer_config_path, "eos_token"
            )
        eos_ids.append(eos_id)
    if not eos_ids:
        log.warning(
            "%s: no end-of-sequence token declared; generation stops only at max_tokens or stop", model_dir
        )

    _apply_bos_eos_flags(tokenizer, tokenizer_config, special_tokens, tokenizer_config_path)

    if model_vocab_size is not None and _id_space(tokenizer) > model_vocab_size:
        # Such ids would index past the embedding matrix as soon as a prompt
        # contained one of those tokens.
        raise CheckpointError(
            f"tokenizer.json has token ids up to {_id_space(tokenizer) - 1}, "
            f"past the model's vocab_size of {model_vocab_size}",
            tokenizer_path,
            "vocab_size",
        )

    template_source = _find_chat_template(model_dir, tokenizer_config)
    try:
        return HFTokenizer(
            tokenizer,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            chat_template=template_source,
            model_vocab_size=model_vocab_size,
        )
    except ChatTemplateError as exc:
        raise CheckpointError(str(exc), model_dir, "chat_template") from exc


def _apply_bos_eos_flags(
    tokenizer: Tokenizer, tokenizer_config: Mapping[str, Any], special_tokens: Mapping[str, str], path: Path
) -> None:
    # Mirrors LlamaTokenizerFast.update_post_processor: only Llama-class
    # tokenizers honour these flags; other classes keep tokenizer.json's
    # post-processor as exported.
    tokenizer_class = str(tokenizer_config.get("tokenizer_class") or "")
    if "Llama" not in tokenizer_class:
        return
    if "add_bos_token" not in tokenizer_config and "add_eos_token" not in tokenizer_config:
        return
    add_bos = bool(tokenizer_config.get("add_bos_token", True))
    add_eos = bool(tokenizer_config.get("add_eos_token", False))
    pieces: list[tuple[str, int]] = []
    for flag, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if not flag:
            continue
        text = special_tokens.get(name)
        token_id = tokenizer.token_to_id(text) if text is not None else None
        if text is None or token_id is None:
            raise CheckpointError(f"add_{name}=true but {name} is not in the vocabulary", path, name)
        pieces.append((text, token_id))
    bos = f"{special_tokens['bos_token']}:0 " if add_bos else ""
    eos = f" {special_tokens['eos_token']}:0" if add_eos else ""
    bos_b = f" {special_tokens['bos_token']}:1" if add_bos else ""
    eos_b = f" {special_tokens['eos_token']}:1" if add_eos else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos}{bos_b} $B:1{eos_b}", special_tokens=pieces
    )


def _find_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside tokenizer_config.json;
    # when both exist the separate file is the newer one.
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"not UTF-8 (byte {exc.start})", jinja_path) from exc
    json_path = model_dir / "chat_template.json"
    template_json = _read_json(json_path, required=False)
    try:
        if template_json is not None:
            return select_template_source(template_json.get("chat_template"))
        return select_template_source(tokenizer_config.get("chat_template"))
    except ChatTemplateError as exc:
        raise CheckpointError(
            str(exc), json_path if template_json is not None else model_dir, "chat_template"
        ) from exc


# --------------------------------------------------------------------------- all together


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# The in-place initialisers nn.Linear and nn.Embedding call in reset_parameters.
_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)


def _leave_uninitialised(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def _skip_random_init() -> Iterator[None]:
    """Random initialisation off while the model is built, as transformers'
    ``no_init_weights`` does: every parameter is overwritten by the checkpoint
    (``load_weights`` refuses one that is not), and filling 1B parameters
    with kaiming-uniform noise first costs ~20 s on two CPU cores. Unlike
    building on the meta device, buffers computed in ``__init__`` (the rotary
    frequencies) keep their values."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, _leave_uninitialised)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def load_model_dir(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM, HFTokenizer]:
    """``(ModelConfig, LlamaForCausalLM, HFTokenizer)`` of a local checkpoint,
    the model in eval mode on ``device`` in the dtype :func:`choose_dtype`
    picks.

    The parameters are created in that dtype rather than cast afterwards: the
    rotary inverse frequencies are built as float32 explicitly and stay so, as
    in transformers, where a cast of the whole module would round them to
    bf16 and shift the angles of long positions.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError("not a directory", model_dir)
    hf_config = read_config(model_dir)
    torch_device = torch.device(device)
    compute_dtype = choose_dtype(hf_config, torch_device, dtype)
    try:
        config = ModelConfig.from_hf(hf_config)
    except ValueError as exc:
        raise CheckpointError(str(exc), model_dir / "config.json") from exc
    tokenizer = load_tokenizer(model_dir, model_vocab_size=config.vocab_size)
    with torch.device(torch_device), _default_dtype(compute_dtype), _skip_random_init():
        model = LlamaForCausalLM(config)
    load_weights(model, model_dir, tie_word_embeddings=config.tie_word_embeddings)
    model.eval()
    return config, model, tokenizer


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "HFTokenizer",
    "choose_dtype",
    "find_weight_files",
    "load_model_dir",
    "load_tokenizer",
    "load_weights",
    "parse_dtype",
    "read_config",
]
