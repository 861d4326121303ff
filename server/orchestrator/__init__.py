"""The disaggregated-serving orchestrator (PROTOCOL.md): config, pools, relay modes, app, CLI."""
