"""A tiny local Qwen3 Hugging Face folder with a chat tokenizer, for running the Tinker
cookbook (0.6.1) offline against jcp-serve: random fp32 weights from transformers and a
byte-level BPE trained with `tokenizers` on a few lines, carrying the chat tokens the
cookbook's `qwen3` renderer writes (<|im_start|>, <|im_end|>, <think>, </think>). The
vocabulary is padded with unused tokens to exactly the model's size, so every id the
sampler can draw decodes."""

from __future__ import annotations

import json
import os

VOCAB = 512
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
CORPUS = [
    "What is 4 + 5? 9",
    "What is 12 + 30? 42",
    "The answer is 17.",
    "Hello, how are you?",
    "I am fine, thank you. And you?",
    "system user assistant",
    "0123456789 + - = ?",
    "You are a helpful assistant.",
    "Tell me a short story about a cat.",
    "Once upon a time there was a small cat who liked numbers.",
]


def tokenizer(path: str, chat_template: str | None = None):
    """Write the tokenizer files to `path` (no torch) -> the transformers tokenizer;
    chat_template: saved with it (tokenizer_config.json / chat_template.jinja)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_tokens([f"<|unused_{i}|>" for i in range(VOCAB - len(fast))], special_tokens=True)
    assert len(fast) == VOCAB, len(fast)
    if chat_template is not None:
        fast.chat_template = chat_template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def build(path: str, seed: int = 0) -> str:
    """Write config.json + model.safetensors + tokenizer files to `path` (once)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    import transformers

    fast = tokenizer(path)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        torch_dtype="float32",
    )
    hm = transformers.Qwen3ForCausalLM(cfg).float()
    hm.save_pretrained(path, safe_serialization=True)
    return path


def build_numpy(path: str, seed: int = 0, chat_template: str | None = None, quiet=None) -> str:
    """The same tiny Qwen3 as `build` (sizes, tokenizer), its random weights drawn with
    NumPy and written without torch (seconds less per test module), its unembedding untied;
    quiet(tokenizer) -> token ids the model (almost) never draws: their logits sit ~25
    below the others'."""
    import numpy as np
    from safetensors.numpy import save_file

    fast = tokenizer(path, chat_template)
    d, f, layers, heads, kv, hd = 64, 96, 2, 4, 2, 16
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.15):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    # Hidden dimension 0 holds a constant (every embedding's 3.0, which no layer writes
    # to): the quiet tokens' unembedding reads it with a large negative weight.
    embed, head = w(VOCAB, d, std=1.0), w(VOCAB, d, std=0.3)
    embed[:, 0], head[:, 0] = 3.0, 0.0
    if quiet is not None:
        head[list(quiet(fast)), 0] = -10.0
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": np.ones(d, np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, d),
                p + "self_attn.k_proj.weight": w(kv * hd, d),
                p + "self_attn.v_proj.weight": w(kv * hd, d),
                p + "self_attn.o_proj.weight": w(d, heads * hd) * (np.arange(d) > 0)[:, None],
                p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
                p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
                p + "mlp.gate_proj.weight": w(f, d),
                p + "mlp.up_proj.weight": w(f, d),
                p + "mlp.down_proj.weight": w(d, f) * (np.arange(d) > 0)[:, None],
                p + "input_layernorm.weight": np.ones(d, np.float32),
                p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            }
        )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        hidden_act="silu",
        attention_bias=False,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        torch_dtype="float32",
    )
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return path


def conversations(path: str, n: int = 8) -> str:
    """A JSONL file of n short chats (the cookbook's FromConversationFileBuilder format)."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 * i + 1, 7 * i + 2
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {a} + {b}?"},
                            {"role": "assistant", "content": f"The answer is {a + b}."},
                        ]
                    }
                )
                + "\n"
            )
    return path
