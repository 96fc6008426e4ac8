"""Generators of what is committed but derived (stubs, docs, contract tables and vectors, old test ledgers): `python -m tools.gen.NAME`."""
