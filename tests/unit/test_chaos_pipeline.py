"""chaos/faults.py types the run it acts on with a Protocol (faults.Pipeline),
so that it imports nothing of chaos/harness.py, which imports it. The
harness's Pipeline must still have every member the protocol names, with the
same signatures: a fault kind would otherwise fail in the middle of a run."""

from __future__ import annotations

import inspect

from chaos import faults, harness


def test_the_harness_pipeline_has_every_member_the_fault_kinds_use(tmp_path):
    run = harness.Pipeline(tmp_path, seed=1)  # builds paths only: no server starts
    missing = [name for name in faults.Pipeline.__annotations__ if not hasattr(run, name)]
    assert missing == []
    for name, member in vars(faults.Pipeline).items():
        if name.startswith("_"):
            continue
        real = inspect.getattr_static(harness.Pipeline, name)
        if isinstance(member, property):
            assert isinstance(real, property), name
        elif inspect.isfunction(member):
            assert inspect.signature(real) == inspect.signature(member), name


def test_the_fault_kinds_do_not_import_the_harness():
    source = inspect.getsource(faults)
    assert "from .harness" not in source and "chaos.harness import" not in source
