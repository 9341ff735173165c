"""Management commands of the accounts app (the package Django looks in)."""
