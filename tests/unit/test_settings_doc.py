"""docs/settings.md's per-setting tables are what the settings' declarations generate, never edited apart."""

from __future__ import annotations

import dataclasses

import pytest

from celery_outbox import Settings as LibrarySettings
from celeryconfig import Settings
from devtools.settings_doc import PAGE, TABLES, deployment_names, render


def test_the_settings_page_is_what_the_declarations_generate() -> None:
    # Given the page as committed, When its tables are generated again from the declarations
    page = PAGE.read_text(encoding="utf-8")
    # Then nothing changes (else: run `python -m devtools settings-doc`)
    assert render(page) == page, "docs/settings.md is stale: run `python -m devtools settings-doc`"


@pytest.mark.parametrize("cls", [LibrarySettings, Settings])
def test_every_field_is_declared_with_a_doc_and_a_rule(cls: type[LibrarySettings]) -> None:
    for f in dataclasses.fields(cls):
        option = cls.OPTIONS[f.name]
        assert option.doc.strip() and "\n" not in option.doc, f.name
        assert cls.RULES[f.name] is option.rule, f.name


def test_every_setting_has_its_row_and_a_hand_edited_row_is_caught() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for f in dataclasses.fields(Settings):
        assert f"| `OUTBOX_{f.name.upper()}` |" in page, f.name
    assert set(deployment_names()) == {"database_url", "broker_url", "routes", "home", "worker_concurrency"}
    # Given a row changed by hand, Then generating again puts the declaration's text back
    edited = page.replace("| `OUTBOX_RELAY_BATCH_SIZE` | 100 |", "| `OUTBOX_RELAY_BATCH_SIZE` | 50 |", 1)
    assert edited != page and render(edited) == page


def test_a_page_without_one_of_the_tables_is_refused() -> None:
    page = PAGE.read_text(encoding="utf-8")
    name = next(iter(TABLES))
    with pytest.raises(ValueError, match="must mark each of"):
        render(page.replace(f"<!-- begin: {name} -->", "", 1))
