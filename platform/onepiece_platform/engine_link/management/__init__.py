"""Management commands of the engine_link app (the package Django looks in)."""
