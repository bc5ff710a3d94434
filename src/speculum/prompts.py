"""Turning user text into prompt token ids (the CLI, the server and the benchmarks share it)."""

from __future__ import annotations

from .errors import SpeculumError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of chat ``messages`` (``[{"role", "content"}, ...]``) through the tokenizer's chat
    template, with the assistant's turn opened (``template_kwargs``: more for the template, e.g.
    ``tools``). :class:`SpeculumError` when the tokenizer has no template or the template rejects
    the messages."""
    if not has_chat_template(tokenizer):
        raise SpeculumError("this model's tokenizer has no chat template: send raw text (--no-chat, or "
                            "/v1/completions on the server)")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **template_kwargs)
    except Exception as e:  # noqa: BLE001 - templates raise anything (jinja errors) on odd input
        raise SpeculumError(f"the chat template rejected the messages: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``: through the chat template (``chat=None``: when the tokenizer has one)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise SpeculumError("the prompt is empty")
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]
