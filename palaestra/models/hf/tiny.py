"""Tiny randomly initialised HF models (:data:`TINY_MODELS`, a character-level tokenizer, :data:`CHAT_TEMPLATE`)
built in code, never downloaded; a name and a seed always give the same weights. They generate noise; what they
prove is that every code path of the HF backend runs for real.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_MODELS", "build_char_tokenizer", "tiny_config"]

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")

# One line, no stray whitespace: ``<|role|>content<|end|>`` per message, tool calls as
# ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tools in a leading system block, and the
# generation prompt ``<|assistant|>``. Unknown roles raise (the server answers 400).
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' ~ m.role) }}{%- endif %}"
    "<|{{ m.role }}|>{%- if m.content is string %}{{ m.content }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function | tojson }}</tool_call>{%- endfor %}"
    "<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)

_COMMON: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False, "rope_theta": 10000.0,
}  # fmt: skip

TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-random-llama": {"architecture": "llama", **_COMMON},
    "tiny-random-qwen2": {"architecture": "qwen2", **_COMMON},
    # the architecture of the HF arithmetic base (palaestra.trainer.pretrain): as wide as arith-base
    "tiny-llama-64": {
        "architecture": "llama", **_COMMON,
        "hidden_size": 64, "intermediate_size": 256, "num_key_value_heads": 4, "max_position_embeddings": 128,
    },
}  # fmt: skip


def build_char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character and :data:`CHAT_TEMPLATE` (no files)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *chars])}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(name: str, vocab_size: int) -> Any:
    """The transformers config of a tiny model (``KeyError`` listing the names if unknown)."""
    spec = TINY_MODELS.get(name)
    if spec is None:
        raise KeyError(f"unknown tiny model {name!r}; available: {', '.join(sorted(TINY_MODELS))}")
    from transformers import AutoConfig

    kwargs = {k: v for k, v in spec.items() if k != "architecture"}  # "architecture" is the model_type
    return AutoConfig.for_model(spec["architecture"], vocab_size=vocab_size, **kwargs)
