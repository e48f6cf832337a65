"""Trace-driven simulation of placement policies."""
