"""The disaggregated-serving orchestrator (docs/protocol.md): config, pools, relay modes, app, CLI."""
