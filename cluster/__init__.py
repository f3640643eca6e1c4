"""Configuration, the local launcher and the ``fairserve`` CLI."""
