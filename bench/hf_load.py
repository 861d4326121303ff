"""Loading a Hugging Face checkpoint and streaming its text, against the obvious alternatives.

``python -m bench.hf_load [--layers N] [--hidden H] [--tokens T]``

- Load: :func:`server.worker.hf.load_model_dir` against what one would write
  by hand: build ``LlamaForCausalLM`` (random init), ``safetensors.torch.load_file``
  each shard, ``load_state_dict(strict=True)``, ``Tokenizer.from_file``. Same synthetic Llama
  checkpoint (bf16 on disk, two shards), same CPU, float32 model.
- Detokenize: text deltas per generated token with the worker's
  :class:`~server.worker.tokenizer.IncrementalDetokenizer` over
  :class:`~server.worker.hf.HFTokenizer`, against ``tokenizers``' own
  ``DecodeStream`` and against re-decoding the whole output every token.
- Chat template: render a 6-turn conversation with the compiled template,
  against compiling it per request.

Ratios are measured in the same run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from bench._timing import format_table, time_call
from server.worker.chat_template import ChatTemplate
from server.worker.hf import load_model_dir, load_tokenizer
from server.worker.model import LlamaForCausalLM, ModelConfig
from server.worker.tokenizer import IncrementalDetokenizer

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SAMPLE_TEXT = (
    "Streaming detokenization emits text as soon as it is final: naïve café prices in € and ¥, "
    "日本語のテキスト, emoji 😀🎉, and plain ASCII words mixed together. "
)


def write_checkpoint(directory: Path, layers: int, hidden: int) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    model = LlamaForCausalLM(ModelConfig.from_hf(config))
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file_name = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([SAMPLE_TEXT * 4] * 50, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML, "tokenizer_class": "Qwen2Tokenizer"})
    )
    return config


def load_by_hand(directory: Path, config: dict) -> torch.nn.Module:
    model = LlamaForCausalLM(ModelConfig.from_hf(config))
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, strict=True)
    Tokenizer.from_file(str(directory / "tokenizer.json"))  # load_model_dir loads it too
    return model.eval()


def bench_load(directory: Path, config: dict) -> list[list[str]]:
    ours = time_call(lambda: load_model_dir(directory, "cpu", torch.float32), min_time=0.5, repeat=3)
    by_hand = time_call(lambda: load_by_hand(directory, config), min_time=0.5, repeat=3)
    params = sum(p.numel() for p in load_by_hand(directory, config).parameters())
    return [
        ["load_model_dir", f"{params / 1e6:.0f}M params", f"{ours * 1e3:.0f} ms", "1.00x"],
        [
            "init + load_file + load_state_dict",
            f"{params / 1e6:.0f}M params",
            f"{by_hand * 1e3:.0f} ms",
            f"{by_hand / ours:.2f}x slower",
        ],
    ]


def bench_detokenize(directory: Path, tokens: int) -> list[list[str]]:
    tokenizer = load_tokenizer(directory)
    ids = tokenizer.encode(SAMPLE_TEXT * (tokens // 20 + 1), add_special_tokens=False)[:tokens]

    def incremental() -> None:
        detokenizer = IncrementalDetokenizer(tokenizer)
        for token in ids:
            detokenizer.push([token])
        detokenizer.flush()

    def decode_stream() -> None:
        stream = decoders.DecodeStream(skip_special_tokens=True)
        for token in ids:
            stream.step(tokenizer.backend, token)

    def full_redecode() -> None:
        previous = ""
        for end in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:end])
            if not text.endswith("\ufffd"):
                previous = text
        del previous

    base = time_call(incremental, repeat=3)
    rows = [["IncrementalDetokenizer (worker)", f"{base / len(ids) * 1e6:.1f} µs", "1.00x"]]
    for name, fn in (("tokenizers DecodeStream", decode_stream), ("re-decode whole output", full_redecode)):
        seconds = time_call(fn, repeat=3)
        rows.append([name, f"{seconds / len(ids) * 1e6:.1f} µs", f"{seconds / base:.2f}x"])
    return rows


def bench_template() -> list[list[str]]:
    messages = [
        {"role": role, "content": SAMPLE_TEXT}
        for role in ("system", "user", "assistant", "user", "assistant", "user")
    ]
    compiled = ChatTemplate(CHATML)
    cached = time_call(lambda: compiled.render(messages))
    # A distinct source each time defeats the compile cache, as a per-request compile would.
    counter = iter(range(1 << 30))
    per_request = time_call(lambda: ChatTemplate(CHATML + "{#" + str(next(counter)) + "#}").render(messages))
    return [
        ["compiled once (ChatTemplate)", f"{cached * 1e6:.0f} µs", "1.00x"],
        ["compiled per request", f"{per_request * 1e6:.0f} µs", f"{per_request / cached:.1f}x"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512, help="generated tokens to detokenize")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        config = write_checkpoint(directory, args.layers, args.hidden)
        print(f"torch threads: {torch.get_num_threads()}")
        print("\n## Loading a 2-shard bf16 checkpoint into a float32 CPU model\n")
        print(format_table(["loader", "size", "time", "ratio"], bench_load(directory, config)))
        print(f"\n## Streaming detokenization, per token ({args.tokens} tokens, byte-level BPE)\n")
        print(format_table(["method", "per token", "ratio"], bench_detokenize(directory, args.tokens)))
        print("\n## Chat template, 6-turn conversation\n")
        print(format_table(["method", "per render", "ratio"], bench_template()))


if __name__ == "__main__":
    main()
