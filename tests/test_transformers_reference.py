"""Our Llama-family model against transformers' own classes, on checkpoints transformers writes.

Each shape is a tiny random config of ``transformers``' LlamaForCausalLM, MistralForCausalLM or
Qwen2ForCausalLM (GQA and MQA, tied and untied embeddings, attention and MLP biases, a head_dim
that is not hidden/heads, default, linear and llama3 rope scaling: what server/worker/model.py
accepts), its weights redrawn at scales that make every part count (norm gains and biases far
from their init, sharp attention), saved by ``save_pretrained``: the source of truth is the
reference's own file layout and config.json, not ours. The same directory is loaded by
:func:`server.worker.hf.load_model_dir` and checked:

- logits of whole prompts within 1e-4 (float32); a mismatch names the first stage (embeddings,
  decoder layer i, the final norm, the logits) where the two models' hidden states part, from
  forward hooks on both (:func:`first_divergence`);
- greedy continuations of 32 tokens identical to ``generate``'s;
- the same continuation served by a context and a generation worker behind an orchestrator on
  127.0.0.1 (the KV handed off), and again for a prompt that extends the first (a prefix-cache
  hit on the context worker), with the context worker's prefill whole or chunked.

The tokenizer is a word-level one (``w17`` is id 17), so served text reads back as ids exactly.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")  # the test extra's; absent: nothing to compare with

import aiohttp
import torch
import transformers
from helpers import free_port
from tiny_workers import one_torch_thread  # noqa: F401
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.worker.app import WorkerSettings, start_worker
from server.worker.engine import TorchEngine
from server.worker.hf import load_model_dir

VOCAB = 320
EOS = 2
TOLERANCE = 1e-4
GREEDY_TOKENS = 32

_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "bos_token_id": 1,
           "eos_token_id": EOS, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}  # fmt: skip

#: shape name -> (transformers model class name, its config class name, config fields)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-gqa-untied": ("LlamaForCausalLM", "LlamaConfig", {
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False, "rope_theta": 500000.0}),
    "llama3-rope-tied-biases": ("LlamaForCausalLM", "LlamaConfig", {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}),
    "llama-linear-rope-mqa": ("LlamaForCausalLM", "LlamaConfig", {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-head-dim": ("MistralForCausalLM", "MistralConfig", {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "sliding_window": None, "tie_word_embeddings": False, "rope_theta": 1000000.0}),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "use_sliding_window": False, "rope_theta": 1000000.0}),
}  # fmt: skip


def word_tokenizer() -> Tokenizer:
    """``▁w0`` .. ``▁w319``: every id decodes to its own whole word (none is special)."""
    vocab = {f"▁w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="▁w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer


def ids_of_text(text: str) -> list[int]:
    """The ids a served text spells (``w17 w4`` -> [17, 4])."""
    return [int(word[1:]) for word in text.split()]


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights at scales where every part shows in the logits: norm gains ~1 +- 0.3, biases
    +- 0.3, q/k 2.5x (sharp attention: positions, hence rope, matter), the layers' outputs 3x
    (else a tied model's greedy text repeats its input), the rest fan-in scaled.
    The EOS row of the output is zeroed so that greedy runs its 32 tokens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.3 * noise)
            else:
                scale = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
                if ".q_proj." in name or ".k_proj." in name:
                    scale *= 2.5
                elif ".o_proj." in name or ".down_proj." in name:
                    scale *= 3.0  # the layers, not the token's own embedding, pick the next token
                param.copy_(noise * scale)
        model.get_output_embeddings().weight[EOS] = 0.0


class Reference:
    """One shape: transformers' model and ours, loaded from the directory the former saved."""

    def __init__(self, shape: str, directory: Path) -> None:
        model_class, config_class, fields = SHAPES[shape]
        config = getattr(transformers, config_class)(**_COMMON, **fields)
        torch.manual_seed(0)
        reference = getattr(transformers, model_class)(config)
        redraw(reference, seed=sum(map(ord, shape)))
        reference.save_pretrained(directory)
        (directory / "tokenizer.json").write_text(word_tokenizer().to_str())
        # the directory as saved, loaded back as transformers loads any checkpoint: float32, its
        # default (sdpa) attention, and its eager one (plain matmuls: no fused kernel shared with us)
        load = getattr(transformers, model_class).from_pretrained
        self.theirs = load(directory, dtype=torch.float32).eval()
        self.eager = load(directory, dtype=torch.float32, attn_implementation="eager").eval()
        self.config, self.ours, self.tokenizer = load_model_dir(directory)
        self.directory = directory


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(request.param, tmp_path_factory.mktemp(request.param))


def prompts(count: int, length: int, seed: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, length), generator=generator)


# -- where two models part --------------------------------------------------------------------------------


def _record(model: torch.nn.Module, decoder: torch.nn.Module, stages: list[torch.Tensor]) -> list[Any]:
    """Forward hooks that append the embeddings, each decoder layer's output and the final norm's."""

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        stages.append((output[0] if isinstance(output, tuple) else output).detach().reshape(-1))

    hooks = [decoder.embed_tokens.register_forward_hook(keep)]
    hooks += [layer.register_forward_hook(keep) for layer in decoder.layers]
    hooks.append(decoder.norm.register_forward_hook(keep))
    return hooks


def stage_names(layers: int) -> list[str]:
    return ["embeddings", *(f"decoder layer {i}" for i in range(layers)), "final norm", "logits"]


def first_divergence(
    theirs: torch.nn.Module, ours: torch.nn.Module, input_ids: torch.Tensor, tolerance: float = TOLERANCE
) -> tuple[str, float] | None:
    """The first stage at which the two models' outputs differ by more than ``tolerance`` (max
    absolute difference, float32), with that difference; None when none does."""
    recorded: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    hooks = _record(theirs, theirs.model, recorded[0]) + _record(ours, ours.model, recorded[1])
    try:
        with torch.no_grad():
            recorded[0].append(theirs(input_ids).logits.reshape(-1))
            recorded[1].append(ours(input_ids).reshape(-1))
    finally:
        for hook in hooks:
            hook.remove()
    names = stage_names(len(ours.model.layers))
    assert len(recorded[0]) == len(recorded[1]) == len(names), "a hook did not fire"
    for name, a, b in zip(names, *recorded):
        difference = (a - b).abs().max().item() if a.shape == b.shape else float("inf")
        if not difference <= tolerance:
            return name, difference
    return None


def test_a_divergence_is_named_at_its_layer(tmp_path: Path) -> None:
    """The helper's own check: one weight of layer 1 changed in our copy is reported at layer 1."""
    ref = Reference("llama-gqa-untied", tmp_path)
    with torch.no_grad():
        ref.ours.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
    assert first_divergence(ref.theirs, ref.ours, prompts(1, 24))[0] == "decoder layer 1"
    with torch.no_grad():
        ref.ours.model.embed_tokens.weight[3:] *= 1.01
    assert first_divergence(ref.theirs, ref.ours, prompts(1, 24))[0] == "embeddings"


# -- in process -------------------------------------------------------------------------------------------


def test_logits_agree_over_whole_prompts(reference: Reference) -> None:
    ids = prompts(2, 96)
    parted = first_divergence(reference.theirs, reference.ours, ids)
    assert parted is None, f"ours and transformers part at {parted[0]} (max |diff| {parted[1]:.3g})"
    with torch.no_grad():
        logits = reference.ours(ids)
        # and the logits are not trivially close: rope, norms and biases all move them
        assert logits.std() > 0.5
        # the eager reference sums in another order: equal up to float32 rounding (2e-4 at a
        # logit of 33 after 4 layers), so within 1e-4 of the logits' largest magnitude
        eager = reference.eager(ids).logits
        assert (logits - eager).abs().max() <= TOLERANCE * eager.abs().max()


def greedy_ours(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy_theirs(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_continuations_are_identical(reference: Reference) -> None:
    prompt = prompts(1, 40)[0].tolist()
    expected = greedy_theirs(reference.theirs, prompt, GREEDY_TOKENS)
    assert len(expected) == GREEDY_TOKENS and EOS not in expected
    assert len(set(expected)) > 4, "a degenerate continuation would prove little"
    assert greedy_ours(reference.ours, prompt, GREEDY_TOKENS) == expected


# -- served: context and generation workers behind an orchestrator ------------------------------------------


async def _served(directory: Path, chunk: int) -> tuple[Any, list[tuple[Any, str, TorchEngine]], str]:
    started = []
    for role in ("context", "generation"):
        config, model, tokenizer = load_model_dir(directory)
        engine = TorchEngine(config, model, tokenizer, kv_tokens=2048, prefix_caching=True,
                             prefill_chunk_tokens=chunk)  # fmt: skip
        server, port = await start_worker(engine, WorkerSettings(role=role, model_name="ref"))
        started.append((server, f"http://127.0.0.1:{port}", engine))
    config = build_config(
        {
            "port": free_port(),
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [started[0][1]]},
            "generation_servers": {"urls": [started[1][1]]},
        },
        environ={},
    )
    front, orch = await start_server(config)
    for _ in range(200):
        if orch.context_pool.ready and orch.generation_pool.ready:
            break
        await asyncio.sleep(0.05)
    return front, started, f"http://127.0.0.1:{config.port}"


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int], **extra: Any) -> Any:
    body = {"model": "ref", "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, **extra}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not extra.get("stream"):
            return await resp.json()
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice.get("text") or ""
        return {"choices": [{"text": text}]}


@pytest.mark.parametrize(
    ("shape", "chunk"),
    # chunk: the context worker's --prefill-chunk-tokens (0: whole prompts; 20: chunks that end
    # inside blocks, the second prompt's remainder across a chunk boundary)
    [(shape, 0) for shape in SHAPES] + [("llama3-rope-tied-biases", 20), ("qwen2-tied", 20)],
)
async def test_served_disaggregated_with_prefix_hits_matches_generate(
    shape: str, chunk: int, tmp_path: Path
) -> None:
    ref = Reference(shape, tmp_path)
    first = prompts(1, 50, seed=11)[0].tolist()
    # the second shares the first's 50 ids (three full 16-id blocks cached on the context worker)
    second = first + prompts(1, 9, seed=12)[0].tolist()
    expected = [greedy_theirs(ref.theirs, p, GREEDY_TOKENS) for p in (first, second)]
    front, started, url = await _served(ref.directory, chunk)
    (_, _, context_engine), (_, _, generation_engine) = started
    try:
        async with aiohttp.ClientSession() as session:
            body = await _complete(session, url, first)
            assert ids_of_text(body["choices"][0]["text"]) == expected[0]
            assert context_engine.prompt_tokens_total >= len(first)  # prefilled there, handed off
            assert context_engine.prefill_steps_total >= (3 if chunk else 1)  # 50 ids, 20 a step
            assert generation_engine.generated_tokens_total >= GREEDY_TOKENS - 1
            computed = context_engine.prompt_tokens_total
            body = await _complete(session, url, second)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
            assert context_engine.prompt_tokens_total - computed == len(second) - 48
            assert ids_of_text(body["choices"][0]["text"]) == expected[1]
            streamed = await _complete(session, url, second, stream=True)  # a hit again, streamed
            assert ids_of_text(streamed["choices"][0]["text"]) == expected[1]
    finally:
        await front.cleanup()
        for server, _, _ in started:
            await server.cleanup()
