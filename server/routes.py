"""A completion's route as a named value: chat completions, completions (and whatever comes next),
each with its name (metrics' ``route`` label), its path and what its body is.

The orchestrator's completion (app.py's routes, completion.py's and exchange.py's drivers) carries a
:class:`Route` from the client's request to the count of its status, instead of a ``chat`` flag read
in each place; the relay modes' kernels still take the flag (``Route.chat``), which is their input.
A new route is one value here and its entry in :data:`BY_PATH`.
"""

from __future__ import annotations

from fastcore import protocol as wire


class Route:
    """One completion route: ``name`` (``chat``, ``completions``), ``path`` (its POST path, bytes, as the
    HTTP layer reads it), ``text`` (the path as a str, for traces) and ``chat`` (a messages body)."""

    __slots__ = ("chat", "name", "path", "text")

    def __init__(self, name: str, text: str, *, chat: bool) -> None:
        self.name = name
        self.text = text
        self.path = text.encode()
        self.chat = chat

    def __repr__(self) -> str:
        return f"Route({self.name!r})"


CHAT = Route("chat", wire.CHAT_COMPLETIONS_PATH, chat=True)
COMPLETIONS = Route("completions", wire.COMPLETIONS_PATH, chat=False)
#: the POST path -> its route
BY_PATH: dict[bytes, Route] = {route.path: route for route in (CHAT, COMPLETIONS)}
