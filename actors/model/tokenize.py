"""Tokenization's one home: a text, a chat, or a command's prompt to token ids, by a model's tokenizer.

Every caller passes the tokenizer: the loaded model's own (LoadedModel.encode: the CLI's `generate`, the benchmarks)
or the copy a tokenizing thread of an API replica holds (deploy/serve/tokenizing.py; a fast tokenizer's state is not
safe to share between threads), so the rules are the same everywhere.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A raw text's token ids (with the tokenizer's special tokens, as the model expects a prompt)."""
    return tokenizer.encode(text)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation through the model's chat template, ending with the assistant's turn to speak, with the
    function tools the template shows the model (OpenAI's shape; the template's own errors, for a conversation it
    rejects, reach the caller)."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """The one prompt-encoding rule of every command (generate, the benchmarks): with `chat`, the prompt goes as one
    user message through the model's chat template when the model has one; a model without a template (a base
    model) gets the raw text, as without `chat`."""
    if chat and tokenizer.chat_template is not None:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return encode_text(tokenizer, prompt)
