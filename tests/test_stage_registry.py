"""Stages register themselves: every module of the stage packages is imported by load_stages, so a new stage is
one new module (CONTRIBUTING.md), and a method's declarations are where it is registered."""

import pkgutil
import sys
from pathlib import Path

import pipeline
from pipeline.stages import STAGE_PACKAGES, load_stages


def test_every_module_of_the_stage_packages_is_loaded():
    stages = load_stages()
    assert {"detect", "annotate", "counterfactual"} <= set(stages)
    root = Path(pipeline.__file__).parent
    for name in STAGE_PACKAGES:
        folder = root / name.split(".", 1)[1]
        modules = [f"{name}.{m.name}" for m in pkgutil.iter_modules([str(folder)])]
        assert modules and all(m in sys.modules for m in modules), name


def test_a_new_stage_module_registers_itself(tmp_path, monkeypatch):
    import pipeline.detect
    import pipeline.stages as stages_mod

    extra = tmp_path / "extra_stage.py"
    extra.write_text(
        "from pipeline.stages import StageOutput, batch_stage\n"
        "@batch_stage('extra_probe', order=99, produces=('extra_probe_table',))\n"
        "def extra(trajectories, steps, config, inputs, io=None):\n"
        "    return StageOutput(tables={})\n"
    )
    monkeypatch.setattr(pipeline.detect, "__path__", [*pipeline.detect.__path__, str(tmp_path)])
    monkeypatch.setattr(stages_mod, "_loaded", False)
    monkeypatch.delitem(stages_mod.STAGES, "extra_probe", raising=False)
    try:
        assert "extra_probe" in load_stages()
        assert stages_mod.STAGES["extra_probe"].produces == ("extra_probe_table",)
    finally:
        stages_mod.STAGES.pop("extra_probe", None)
        sys.modules.pop("pipeline.detect.extra_stage", None)
