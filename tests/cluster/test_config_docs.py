"""docs/configuration.md is the page ``python -m cluster.config_docs`` generates from the
settings models (as tests/helm/test_render.py holds the chart's values to
helm/chart_values.py): a setting added, changed or described anew shows there, or this fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster import config_docs
from cluster.settings import FairserveSettings

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_the_generated_one() -> None:
    check = subprocess.run([sys.executable, "-m", "cluster.config_docs", "--check"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr + "\nrun `make docs-config` and commit the page"


def test_every_setting_has_a_row() -> None:
    page = config_docs.render()

    def paths(model: type, prefix: str) -> list[str]:
        found: list[str] = []
        for name, info in model.model_fields.items():
            sub = config_docs._model_of(info.annotation)
            listed = config_docs._list_model_of(info.annotation)
            if sub is not None:
                found += paths(sub, f"{prefix}{name}.")
            elif listed is not None and prefix == "":
                found += [f"models[].{n}" for n in listed.model_fields
                          if n not in ("engine", "replicas")]
            else:
                found.append(f"{prefix}{name}")
        return found

    missing = [p for p in paths(FairserveSettings, "") if f"| `{p}` |" not in page]
    assert missing == [], f"settings without a row in docs/configuration.md: {missing}"


def test_the_page_names_no_machine_path() -> None:
    page = config_docs.render()
    assert str(Path.home()) not in page and sys.prefix not in page
