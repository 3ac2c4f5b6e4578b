"""Placing stage processes beyond the client's host (Ray); imported only when a config asks for it."""
