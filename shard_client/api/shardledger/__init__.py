"""Generated code: never edit by hand; run python -m tools.gen.stubs."""
