"""The HTTP parsers, chosen once at import: the compiled twins unless they are missing or
``FASTCORE_NO_EXTENSIONS=1`` is set (as for :mod:`fastcore`'s modules).

- :mod:`server.http._parse`: llhttp's callbacks in C; the request line and headers read into C
  buffers, checked there, and handed to Python once per request (a response's four headers used
  read there too);
- :mod:`server.http._parse_py`: its pure-Python twin on httptools (a Python call per header).

Each has :class:`RequestParser` (a client connection's, with the same events and refusals in
both) and :class:`ResponseParser` (an upstream connection's). :class:`~server.http.HTTPServer`
uses :data:`RequestParser` (its class attribute ``request_parser``) and
:class:`~server.http.UpstreamPool` :data:`ResponseParser` (``response_parser``); the tests set
them per twin in subclasses.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fastcore import NO_EXTENSIONS

from . import _parse_py


def _load() -> tuple[ModuleType, str]:
    if not NO_EXTENSIONS:
        try:
            return importlib.import_module("._parse", __package__), "cython"
        except ImportError:
            pass
    return _parse_py, "python"


#: ``backend``: ``"cython"`` or ``"python"``, which twin :data:`RequestParser` is
_impl, backend = _load()

#: the request parser every :class:`~server.http.HTTPServer` uses unless its class says otherwise
RequestParser = _impl.RequestParser
#: the response parser every :class:`~server.http.UpstreamPool` uses unless its class says otherwise
ResponseParser = _impl.ResponseParser

__all__ = ["RequestParser", "ResponseParser", "backend"]
