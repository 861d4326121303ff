"""The orchestrator's compiled twins, chosen once at import: :mod:`server.orchestrator._tally` unless
it is missing or ``FASTCORE_NO_EXTENSIONS=1`` is set (as :mod:`fastcore` and
:mod:`server.http.parse` choose theirs).

``_tally`` holds the C twins of the per-request numbers: :mod:`.metrics`' ``TallyOne``,
``TallyHistogram`` and ``NoClock``, :mod:`.estimates`' ``BytesPerToken``, :mod:`.pools`'
``CircuitBreaker``. Each of those modules keeps its pure class (the behavioural reference) under
``PURE`` and exports the twin chosen here under the class's name.
"""

from __future__ import annotations

from fastcore import compiled_twin

#: the compiled module, or None (the pure classes are used)
tally = compiled_twin("server.orchestrator._tally")
#: ``"cython"`` or ``"python"``: which twins the orchestrator counts with
backend = "python" if tally is None else "cython"
