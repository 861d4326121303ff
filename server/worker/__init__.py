"""The torch worker: model, tokenizers, continuous-batching engine and its aiohttp app.

``protocol`` (OpenAI request parsing and response/SSE building) imports no
torch, so the orchestrator and a synthetic engine can reuse it.
"""
