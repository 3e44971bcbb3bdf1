"""Scheduler interface, default machinery and its output types."""
