"""The stage tests' fixtures: ``tiny_models`` and ``input_png`` are plugins (tests.fixtures.models)."""
