"""Prompt encoding: the token ids the rollout manager sends, with and without the chat template."""

from __future__ import annotations

from rl.model import load_tokenizer
from rl.rollout.batch import encode_prompt


def test_chat_template_prompt_is_the_rendered_turn_token_by_token(chat_model_path):
    tokenizer = load_tokenizer(chat_model_path)  # as the manager loads it
    ids = encode_prompt(tokenizer, "a b:", chat_template=True)
    # one token per character, one per role token (independent of any encode call)
    tokens = ["<|system|>", *"answer briefly.", "<|end|>", "<|user|>", *"a b:", "<|end|>", "<|assistant|>"]
    assert ids == tokenizer.convert_tokens_to_ids(tokens)
    assert all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "<|system|>answer briefly.<|end|><|user|>a b:<|end|><|assistant|>"


def test_plain_prompt_is_its_characters(chat_model_path):
    tokenizer = load_tokenizer(chat_model_path)
    assert encode_prompt(tokenizer, "a b:", chat_template=False) == \
        tokenizer.convert_tokens_to_ids(list("a b:"))
