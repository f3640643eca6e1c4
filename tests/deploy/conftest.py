"""``image`` tests build a container image (minutes, root, buildah): they run only when the
marker expression names them (``-m image``, ``make test-image``), so a plain ``pytest`` never
starts a build. ``make test`` deselects them."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "image" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="builds a container image: run with -m image")
    for item in items:
        if item.get_closest_marker("image") is not None:
            item.add_marker(skip)
