"""The engine_link app's commands: reconcile (engine events into the ledger)."""
