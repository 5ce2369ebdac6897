"""Choosing an engine for a request. Pure Python: no Django, no ML libraries."""
