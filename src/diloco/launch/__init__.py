"""Launching on one machine: child processes, the evaluator, the live view and ``diloco run``."""
