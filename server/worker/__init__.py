"""The torch worker: model, tokenizers, continuous-batching engine and its aiohttp app.

Layers, from the wire down:

- ``protocol``: OpenAI request parsing, response and SSE building (no torch);
- ``app``: the aiohttp routes, roles, KV hand-off endpoint and metrics, over
  the ``engine_api.Engine`` contract (no torch at import);
- ``engine`` (+ ``kv_cache``, ``kv_transfer``): the torch engine thread;
  ``synthetic``: an engine with no model, for orchestrator benchmarks;
- ``model``, ``tokenizer``, ``tiny``, ``hf``: what the engine runs.
"""
