"""End-to-end contracts across the server, the SDK and the CLI: nights, Slurm, verdicts, import graph."""
