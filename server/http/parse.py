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

from types import ModuleType

from fastcore import compiled_twin

from . import _parse_py

_compiled = compiled_twin("server.http._parse")
_impl: ModuleType = _parse_py if _compiled is None else _compiled
#: ``"cython"`` or ``"python"``: which twin :data:`RequestParser` is
backend = "python" if _compiled is None else "cython"

#: the request parser every :class:`~server.http.HTTPServer` uses unless its class says otherwise
RequestParser = _impl.RequestParser
#: the response parser every :class:`~server.http.UpstreamPool` uses unless its class says otherwise
ResponseParser = _impl.ResponseParser

__all__ = ["RequestParser", "ResponseParser", "backend"]
