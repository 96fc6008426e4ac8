"""Nightly-size fault campaigns and coverage-guided fuzzing: `python -m tools.campaign` (nightly.py)."""
