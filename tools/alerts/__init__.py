"""Checks of the Prometheus alert rules (check.sh) and their shortened-window copy (windows.py)."""
