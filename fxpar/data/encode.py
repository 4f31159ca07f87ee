"""Documents to token ids and labels: plain text, and chat rendered by the tokenizer's chat template.

Text: ``tokenizer(text)`` (which adds BOS where the tokenizer does so itself) then EOS; every token is
a label. Chat: ``apply_chat_template(..., return_assistant_tokens_mask=True)``, the labels -100 on every
token but the assistant's (TRL's assistant-only loss). That mask needs ``{% generation %}`` markers in
the template; a template without them (most shipped ones) falls back to a rule that holds for any
template that renders a conversation as the concatenation of its turns: render ``messages[:i]`` with
the generation prompt and ``messages[:i+1]`` without, and mark the tokens the assistant message adds.
Where the shorter rendering is not a prefix of the longer one that rule cannot work, and it says so.
Every document ends with EOS (appended where the text or template does not end with it), so packed
documents stay separated; an EOS fxpar appends to a chat is not a label (the template did not put it
there).
"""

from __future__ import annotations

import re

from fxpar.ir.errors import PlanError

IGNORE = -100
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def encode_text(tok, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per text: the tokenizer's own special tokens, then EOS; labels = ids."""
    eos = tok.eos_token_id
    out = []
    for ids in tok(texts, verbose=False)["input_ids"]:
        ids = list(ids)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        out.append((ids, list(ids)))
    return out


def _template_text(template) -> str:
    return template if isinstance(template, str) else " ".join(str(v) for v in dict(template).values())


def encode_chat(tok, conversations: list[list[dict]], where,
                rows: list | None = None) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per conversation; labels -100 except on the assistant's tokens. ``rows``: how
    an error names each conversation (default its 1-based row number; a streamed reader gives byte offsets)."""
    if not getattr(tok, "chat_template", None):
        raise PlanError(f"data {where}: the file is chat data (messages) but the tokenizer has no chat_template",
                        fix="use a tokenizer with a chat template (tokenizer.chat_template = ..., save_pretrained), "
                            "or train on a text column with --format json --field <name>")
    markers = bool(GENERATION_TAG.search(_template_text(tok.chat_template)))
    eos = tok.eos_token_id
    out = []
    for row, messages in zip(rows or range(1, len(conversations) + 1), conversations):
        mask = None
        if markers:
            enc = _apply(tok, messages, where, row, return_assistant_tokens_mask=True)
            ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
            if not any(mask) and _speaks(messages):
                mask = None  # markers that mark nothing for this conversation: use the general rule
        if mask is None:
            ids, mask = prefix_mask(tok, messages, where, row)
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        if not ids or ids[-1] != eos:
            ids.append(eos)
            labels.append(IGNORE)
        out.append((ids, labels))
    return out


def _speaks(messages: list[dict]) -> bool:
    return any(m["role"] == "assistant" and m.get("content") for m in messages)


def row_label(row) -> str:
    """How an error names a row: ``row N (1-based)`` for a number, else the given words."""
    return f"row {row} (1-based)" if isinstance(row, int) else str(row)


def _apply(tok, messages, where, row, **kwargs):
    try:
        return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as e:  # the template itself raised (e.g. roles that must alternate)
        raise PlanError(f"data {where}: {row_label(row)}: the chat template failed on it: {type(e).__name__}: {e}",
                        fix="fix the conversation (roles, order) or the tokenizer's chat template") from e


def prefix_mask(tok, messages: list[dict], where, row: int = 0) -> tuple[list[int], list[int]]:
    """The ids of ``messages`` and a 0/1 mask of the tokens each assistant message adds, found by
    rendering prefixes (see the module docstring); :class:`PlanError` where a prefix renders unstably."""
    ids = list(_apply(tok, messages, where, row)["input_ids"])
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = list(_apply(tok, messages[:i], where, row, add_generation_prompt=True)["input_ids"])
        upto = list(_apply(tok, messages[:i + 1], where, row)["input_ids"])
        if upto[:len(before)] != before or ids[:len(upto)] != upto:
            raise PlanError(f"data {where}: {row_label(row)}: the chat template renders message {i} (assistant) "
                            "differently once the conversation goes on, so its tokens cannot be found by prefixes",
                            fix="mark the assistant turns of the chat template with {% generation %} ... "
                                "{% endgeneration %} (transformers' return_assistant_tokens_mask)")
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    return ids, mask
