"""The JSON limits every fastcore process enforces: one definition, so all parsers agree.

The orchestrator's span scanner (both twins, and every relay kernel built on it),
the orchestrator's ``parsed`` relay mode and the workers' request parsers refuse
the same bodies with the same 400, rather than one of them passing a body that
another cannot build (a ``RecursionError`` or an ``int()`` refusal is a 500, and a
500 gets retried on another worker).

- :data:`JSON_MAX_DEPTH`: arrays and objects open at once, the body itself being
  level 1. ``json.loads`` recurses once per level and fails near Python's
  recursion limit (1000, less whatever the caller's stack already holds);
  pysimdjson's default is 1024. 512 is clear of both, and far above any
  request shape of the OpenAI API (chat content parts nest about 5 deep).
- :data:`JSON_MAX_NUMBER_CHARS`: the length of one number token (sign, digits,
  fraction, exponent). Every encoder writes an int64 or a float64 in at most 24
  characters (shortest round-trip form); 256 leaves ten times that for
  fixed-notation writers. It is below 640, the smallest limit
  ``sys.set_int_max_str_digits`` accepts, so an integer that passes converts in
  every process whatever its setting, and its conversion cost stays bounded.
  Strings are not numbers: a long string of digits is not limited here.
"""

from __future__ import annotations

#: Deepest nesting of arrays and objects a JSON document may have; the document itself is level 1.
JSON_MAX_DEPTH = 512

#: Longest number token (``-``, digits, ``.``, exponent) a JSON document may hold.
JSON_MAX_NUMBER_CHARS = 256

__all__ = ["JSON_MAX_DEPTH", "JSON_MAX_NUMBER_CHARS"]
