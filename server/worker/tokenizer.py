"""The tokenizer protocol the worker uses, the built-in byte-level tokenizer of ``tiny``,
and incremental detokenization for streaming.

Any tokenizer (this module's :class:`ByteTokenizer`, the Hugging Face one in
``hf.py``) provides:

- ``encode(text, add_special_tokens=True) -> list[int]``. The worker passes
  ``add_special_tokens=False`` for rendered chat templates, which already
  hold their BOS, and ``True`` for plain completion prompts.
- ``decode(ids) -> str``: bytes that do not form whole UTF-8 characters
  decode to U+FFFD, as ``bytes.decode(errors="replace")`` does.
- ``apply_chat_template(messages, add_generation_prompt=True, tools=None) -> str``
  (``tools``: the request's function schemas, as ``transformers`` passes them;
  passed only when the request has some).
- ``eos_token_ids`` (list of ids that end generation), ``vocab_size``,
  ``bos_token_id`` (or None).

:class:`IncrementalDetokenizer` turns a growing id sequence into text deltas
with nothing but ``decode``, so it serves every implementation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence that never split a character.

    The "decode a window, emit the stable suffix" method of vLLM/TGI: decode
    the ids from ``prefix_offset`` twice, with and without the new ones, and
    emit the difference once it no longer ends in U+FFFD, i.e. once no
    multi-byte UTF-8 character is still waiting for its continuation bytes.
    Decoding a short window (not the whole sequence) keeps each step O(window)
    and gives tokenizers whose pieces depend on their left neighbour (SentencePiece's
    leading space) the context they need.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        # A few prompt ids as left context, as vLLM does, for tokenizers whose
        # first piece decodes differently at the start of a sequence.
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The text so far as its deltas (joined when read: a string grown by += is copied whole
        # at each push, quadratic over a long answer)
        self._pieces: list[str] = []
        # The decode of ids[prefix_offset:read_offset] while the offsets stay (a character or a
        # piece still incomplete): one decode a push instead of two while text is held.
        self._prefix_text: str | None = None
        #: id -> its text where that text is final alone, whatever comes before or after (the
        #: tokenizer's ``plain_pieces``, if it has them: the byte tokenizer's ASCII bytes)
        self._plain: Sequence[str | None] = getattr(tokenizer, "plain_pieces", ())

    def push_one(self, token_id: int) -> str:
        """:meth:`push` of one id: the same text, without a decode where nothing is held and the
        id's text is final alone (a decode step pushes one id a stream, two decodes each)."""
        plain = self._plain
        if (
            token_id < len(plain)
            and (piece := plain[token_id]) is not None
            and self.read_offset == len(self.ids)
        ):
            # What push computes here: the window's prefix is final, so its decode plus this
            # piece is the window's, and the piece the delta.
            self.ids.append(token_id)
            self.prefix_offset = self.read_offset
            self.read_offset += 1
            self._pieces.append(piece)
            self._prefix_text = piece  # the new window's prefix is this id alone, final as it is
            return piece
        return self.push((token_id,))

    def push(self, new_ids: Iterable[int]) -> str:
        """Add ids; return the text that is now final (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._pieces.append(delta)
            # The new window's prefix is decoded at the next push: a piece may decode differently
            # after its left neighbour than alone (SentencePiece), so new_text cannot give it.
            self._prefix_text = None
            return delta
        self._prefix_text = prefix_text
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is left, incomplete characters as U+FFFD."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = None
        self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All the text returned so far."""
        return "".join(self._pieces)


class ByteTokenizer:
    """Ids 0..255 are bytes; the ids above are special tokens written ``<|name|>`` in text.

    The tokenizer of the built-in ``tiny`` model. Its chat template::

        <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>

    (the system turn only when given; a ``developer`` message is a system turn).
    Tools (docs/protocol.md, "Tool calls") use no special tokens, so the
    vocabulary, hence the seeded model, stays as it is: the request's tools are
    a ``# Tools`` block of one JSON schema a line at the end of the first
    system turn (a system turn of their own when there is none); an assistant
    turn's calls follow its text as ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` (the ``hermes`` parser's format); a ``tool`` message
    is a user turn ``<tool_response>...</tool_response>``. Special-token
    strings in user text are recognised as the special tokens, as Hugging Face
    tokenizers do.
    """

    SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    ROLES = ("system", "developer", "user", "assistant", "tool")

    def __init__(self) -> None:
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.special_strings = {i: s for s, i in self.special_ids.items()}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.bos_token_id: int | None = self.special_ids["<|bos|>"]
        self.eos_token_ids = [self.special_ids["<|eos|>"], self.special_ids["<|end|>"]]
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")
        #: IncrementalDetokenizer's pieces final alone: an ASCII byte is one character whatever
        #: bytes come before it (an incomplete sequence before it decodes alike, ended or not)
        self.plain_pieces: list[str | None] = [chr(i) for i in range(128)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = [self.special_ids["<|bos|>"]] if add_special_tokens else []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(ids, (list, tuple)):  # not an array: bytes() would read its buffer
            try:
                # Bytes only (a stream's usual window): one C call. bytes() refuses an id past 255
                # or below 0, which the loop below then writes as its special token or names.
                return bytes(ids).decode("utf-8", errors="replace")
            except (ValueError, TypeError):
                pass
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if i in self.special_strings:
                out.append(self.special_strings[i])
            else:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        parts = ["<|bos|>"]
        tools_block = ""
        if tools:
            lines = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
            tools_block = (
                f"# Tools\n{lines}"
                + 'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
            )
            if not messages or messages[0].get("role") not in ("system", "developer"):
                parts.append(f"<|system|>{tools_block}<|end|>")
                tools_block = ""
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in self.ROLES:
                raise ValueError(
                    f"messages[{index}].role must be one of {', '.join(self.ROLES)}, got {role!r}"
                )
            text = message_text(message, index)
            if role in ("system", "developer"):
                if tools_block:
                    text, tools_block = f"{text}\n\n{tools_block}" if text else tools_block, ""
                parts.append(f"<|system|>{text}<|end|>")
            elif role == "tool":
                parts.append(f"<|user|><tool_response>{text}</tool_response><|end|>")
            else:
                calls = "".join(_tool_call_text(call) for call in message.get("tool_calls") or ())
                parts.append(f"<|{role}|>{text}{calls}<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


def _tool_call_text(call: dict[str, Any]) -> str:
    """An assistant's call as the ``tiny`` format writes it (its arguments already an object:
    tool_calls.template_messages)."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


def message_text(message: dict[str, Any], index: int) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"messages[{index}].content[{j}] must be a text part ({{'type': 'text', 'text': ...}})"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


__all__ = ["ByteTokenizer", "IncrementalDetokenizer", "Tokenizer", "message_text"]
