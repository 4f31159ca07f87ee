"""Choosing and checking plans without building them: every check here is a pure function."""
