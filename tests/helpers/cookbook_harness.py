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
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>")
CORPUS = [
    "What is 4 + 5? 9", "What is 12 + 30? 42", "The answer is 17.", "Hello, how are you?",
    "I am fine, thank you. And you?", "system user assistant", "0123456789 + - = ?",
    "You are a helpful assistant.", "Tell me a short story about a cat.",
    "Once upon a time there was a small cat who liked numbers.",
]


def build(path: str, seed: int = 0) -> str:
    """Write config.json + model.safetensors + tokenizer files to `path` (once)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens([f"<|unused_{i}|>" for i in range(VOCAB - len(fast))], special_tokens=True)
    assert len(fast) == VOCAB, len(fast)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), torch_dtype="float32")
    hm = transformers.Qwen3ForCausalLM(cfg).float()
    hm.save_pretrained(path, safe_serialization=True)
    return path


def conversations(path: str, n: int = 8) -> str:
    """A JSONL file of n short chats (the cookbook's FromConversationFileBuilder format)."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 * i + 1, 7 * i + 2
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"The answer is {a + b}."}]}) + "\n")
    return path
