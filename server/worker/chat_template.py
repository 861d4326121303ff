"""Chat templates of Hugging Face checkpoints, rendered the way ``transformers`` does.

A checkpoint's ``tokenizer_config.json`` carries a Jinja2 ``chat_template``
(newer exports put it in ``chat_template.jinja`` or ``chat_template.json``
instead). ``transformers`` compiles it in an ``ImmutableSandboxedEnvironment``
with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block tag, a ``tojson`` filter that keeps non-ASCII text,
and the globals ``raise_exception`` and ``strftime_now``; it renders with
``messages``, ``add_generation_prompt``, ``tools``, ``documents`` and the
special tokens (``bos_token``, ``eos_token``, ...) as strings. Templates are
written against exactly that environment (whitespace included), so this module
reproduces it: the same prompt text, hence the same token ids, as the
reference implementation (``transformers/utils/chat_template_utils.py``).

The template is untrusted input from a downloaded directory, hence the
sandbox: attribute access to Python internals raises instead of running.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or it refused the conversation.

    A ``ValueError`` so the server answers 400: most templates call
    ``raise_exception`` for conversations they do not accept (roles out of
    order, a system message in the wrong place), which is the client's
    problem, not the server's.
    """


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    ``transformers`` uses the tag to find the assistant's spans for training
    masks; some published templates contain it, so without the tag they would
    not compile at all. Serving only needs the text.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute as a set

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; the
    # templates expect plain json.dumps output (tool schemas end up in the prompt).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile: {exc.message} (template line {exc.lineno})"
        ) from exc


class ChatTemplate:
    """A compiled Jinja2 chat template and the special-token strings it sees.

    ``special_tokens`` maps ``bos_token``, ``eos_token``, ... to their text;
    they are passed to every render, as ``transformers`` does.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages``.

        ``extra`` reaches the template as further variables (OpenAI's
        ``chat_template_kwargs``, e.g. ``enable_thinking``); it cannot override
        ``messages`` or ``add_generation_prompt``.
        """
        variables: dict[str, Any] = {**self.special_tokens, **extra}
        variables["messages"] = list(messages)
        variables["add_generation_prompt"] = add_generation_prompt
        variables["tools"] = list(tools) if tools is not None else None
        variables["documents"] = list(documents) if documents is not None else None
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {exc}") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            # A template indexing content that the request shaped differently
            # (e.g. content as a list of parts where it expects a string).
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


# Used when a checkpoint ships no template (base models). It frames each turn
# by role so that a chat request still produces a well-delimited prompt; it is
# not what the model was trained on, which is why it is only a fallback.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def select_template_source(raw: Any, *, name: str = "default") -> str | None:
    """The template text from a ``chat_template`` field, which is a string or a
    list of ``{"name", "template"}`` (multi-template checkpoints such as
    Command-R); ``name`` picks one, ``"default"`` otherwise, else the first."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        by_name = {
            entry.get("name"): entry.get("template")
            for entry in raw
            if isinstance(entry, dict) and isinstance(entry.get("template"), str)
        }
        if name in by_name:
            return by_name[name]
        if "default" in by_name:
            return by_name["default"]
        if by_name:
            return next(iter(by_name.values()))
    raise ChatTemplateError(
        f"chat_template must be a string or a list of {{'name', 'template'}} objects, not {type(raw).__name__}"
    )


__all__ = ["FALLBACK_CHAT_TEMPLATE", "ChatTemplate", "ChatTemplateError", "select_template_source"]
