"""The verification levels: what each one does, said once (rayexport/common/levels.py), and the
command lines offering them."""

from __future__ import annotations

import dataclasses

import pytest

from rayexport.common import levels
from rayexport.common.levels import AUTO, FULL, LEVELS, NONE, QUICK
from rayexport.verification.reload.parent import reload_mode


def test_auto_is_full_and_every_other_level_is_itself():
    assert levels.resolved(AUTO) == FULL
    assert [levels.resolved(level) for level in (FULL, QUICK, NONE)] == [FULL, QUICK, NONE]


def test_what_each_level_checks():
    meanings = {
        level: (levels.runs_checks(level), levels.reads_whole_files(level), levels.loads_weights(level))
        for level in (FULL, QUICK, NONE)
    }
    assert meanings == {FULL: (True, True, True), QUICK: (True, False, False), NONE: (False, True, True)}


@pytest.mark.parametrize("level, weights, bound, mode", [
    (FULL, 10, 100, "in-memory"), (FULL, 100, 10, "streamed"), (QUICK, 10, 100, "keys-only"), (QUICK, 100, 10, "keys-only"),
])
def test_the_level_and_the_memory_bound_pick_the_reload_mode(level, weights, bound, mode):
    assert reload_mode(level, weights, bound) == mode


def test_the_export_options_offer_every_level_and_default_to_auto():
    from rayexport.orchestration.options import ExportOptions

    verify = next(item for item in dataclasses.fields(ExportOptions) if item.name == "verify")
    assert verify.metadata["choices"] == LEVELS == ("auto", "full", "quick", "none") and verify.default == AUTO


def test_rayexport_verify_rechecks_at_full_or_quick(capsys):
    from rayexport.verify import main

    with pytest.raises(SystemExit):
        main(["some-uri", "--level", NONE])
    error = capsys.readouterr().err
    assert "invalid choice: 'none'" in error and "full" in error and "quick" in error
