"""Turning user text into prompt token ids."""

from __future__ import annotations

from .errors import SpeculumError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``: through the chat template (``chat=None``: when the tokenizer has one)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise SpeculumError("the prompt is empty")
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        if not has_chat_template(tokenizer):
            raise SpeculumError("this model's tokenizer has no chat template: use --no-chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]
