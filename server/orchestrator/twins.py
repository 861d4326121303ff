"""The orchestrator's compiled twins, chosen once at import, each unless it is missing or
``FASTCORE_NO_EXTENSIONS=1`` is set (:func:`fastcore.compiled_twin`, as :mod:`fastcore` and
:mod:`server.http.parse` choose theirs).

Each is a pure module compiled from its own source in Cython's pure-Python mode (setup.py, typed by
the ``.pxd`` of the compiled name): :mod:`.tally` as ``_tally`` (``TallyOne``, ``TallyHistogram``,
``NoClock``, exported by :mod:`.metrics`), :mod:`.bytes_per_token` as ``_bytes_per_token``
(:mod:`.estimates`' ``BytesPerToken``), :mod:`.breaker` as ``_breaker`` (:mod:`.pools`'
``CircuitBreaker``). A module that exports one keeps the pure class (the behavioural reference)
under ``PURE`` and the twin chosen here under the class's name. The compiled source cannot choose
itself at its own end, as a pure module beside a hand-written ``_x.pyx`` does: it would run the
choice inside the compiled twin too.
"""

from __future__ import annotations

from fastcore import compiled_twin

#: the compiled modules, each None where it is not used (the pure classes are)
tally = compiled_twin("server.orchestrator._tally")
bytes_per_token = compiled_twin("server.orchestrator._bytes_per_token")
breaker = compiled_twin("server.orchestrator._breaker")
#: ``"cython"`` or ``"python"``: which twins the orchestrator counts with
backend = "python" if tally is None else "cython"
