"""Stages register themselves: every module of the stage packages is imported by load_stages, so a new stage is
one new module (CONTRIBUTING.md), and a method's declarations are where it is registered."""

import pkgutil
import sys
from pathlib import Path

import pytest

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


# ---- every batch stage declares what it reads: run each from its declaration alone, recording its settings --


def _failing_llm(settings):
    """An LLM client whose every request failed for good (endpoint down): the stages degrade, reading what
    they read on the way."""
    from pipeline.llm import LLMError

    class Down:
        records: list = []

        def run_batch(self, requests):
            return [LLMError("connection", "down (test)") for _ in requests]

    return Down()


def _round():
    """One batch every method can run on: verifier scores, behaviour logprobs, critic values."""
    import pyarrow as pa
    from tcpo_data import make_batch

    from schemas import TABLES

    groups = [[[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], [[0.5], [1.0]]]
    meta = {"verifier": "em", "golden_answers": ["Paris"]}
    traj, steps = make_batch(groups, meta=meta, action_format="search_r1")
    n = [len(t) for t in steps.column("token_ids").to_pylist()]
    values = pa.array([[0.25] * k for k in n], steps.schema.field("values").type)
    steps = steps.set_column(steps.schema.get_field_index("values"), "values", values)
    return traj, TABLES["steps"].conform(steps)  # the value moments of the new values (derived columns)


def _all_methods() -> list[str]:
    from pipeline.credit.registry import ESTIMATORS, REFINERS

    return sorted(ESTIMATORS) + [f"grpo+{r}" for r in sorted(REFINERS)]


def run_declared(config, traj, steps, record: list[str]) -> dict[str, set[str]]:
    """Every stage of the round in order, in memory, each fed only what its declaration says it reads and
    checked to return what it says it writes; returns per stage the settings models it read."""
    from pipeline.credit.process import STATS
    from pipeline.stages import StageIO, execute, method_key, round_stages

    lake: dict[str, object] = {}
    read: dict[str, set[str]] = {}
    io = StageIO(llm=_failing_llm)
    for stage in round_stages(config):
        cols = stage.columns(config)
        inputs = {t: lake[t] for t in stage.tables_needed(config)}
        inputs |= {
            method_key(t, m): lake[method_key(t, m)] for t in stage.needs_per_method for m in config.methods
        }
        if stage.round_statistics and STATS in lake:
            inputs[STATS] = lake[STATS]
        record.clear()
        out = execute(stage.fn(traj, steps.select(cols) if cols else steps, config, inputs, io=io), io)
        read[stage.name] = set(record)
        written = set(stage.produces) | {
            method_key(t, m) for t in stage.produces_per_method for m in config.methods
        }
        assert set(out.tables) == written, stage.name
        lake |= out.tables
    return read


@pytest.mark.parametrize("annotator", ["rules", "llm"])
def test_every_stage_reads_only_the_settings_it_declares(monkeypatch, annotator):
    """A stage's cache key holds the settings it declares; one it reads without declaring would leave a
    stale result cached when that setting changes. Each stage's every settings lookup
    (`config.settings(Model)` / `config.settings_named(name)`, both validated in `Config._validated`) is
    recorded while it runs and must be among its declared settings: every method together and each alone
    (a method's credit key holds only its own methods' settings), both annotators."""
    from pipeline.config import Config
    from pipeline.stages import round_stages

    record: list[str] = []
    original = Config._validated

    def recording(self, name, model):
        record.append(name)
        return original(self, name, model)

    traj, steps = _round()
    every = _all_methods()
    for methods in [every] + [[m] for m in every]:
        config = Config(methods=methods, annotator=annotator)
        if methods == every:
            assert {s.name for s in round_stages(config)} == set(load_stages())  # every stage runs
        monkeypatch.setattr(Config, "_validated", recording)
        read = run_declared(config, traj, steps, record)
        monkeypatch.undo()
        for name, names in read.items():
            declared = set(load_stages()[name].settings_read(config))
            assert names <= declared, f"{methods}: stage {name!r} reads {sorted(names - declared)} undeclared"
        if methods == every:
            assert read["counterfactual"] >= {"counterfactual", "tcpo"}


def test_the_check_fails_on_an_undeclared_read(monkeypatch):
    """The check above can fail: a stage that reads `grpo` but declares nothing is caught."""
    import pipeline.stages as stages_mod
    from pipeline.config import Config
    from pipeline.stages import StageOutput, batch_stage

    load_stages()

    @batch_stage("probe", order=70, produces=("probe_table",), runs_if=lambda c: True)
    def probe(trajectories, steps, config, inputs, io=None):
        config.settings_named("grpo")
        return StageOutput({"probe_table": trajectories})

    record: list[str] = []
    original = Config._validated
    monkeypatch.setattr(Config, "_validated", lambda self, n, m: (record.append(n), original(self, n, m))[1])
    try:
        read = run_declared(Config(methods=["grpo"]), *_round(), record)
        declared = set(stages_mod.STAGES["probe"].settings_read(None))
    finally:
        stages_mod.STAGES.pop("probe")
    assert read["probe"] == {"grpo"} and not read["probe"] <= declared


def test_declarations_name_registered_settings_and_existing_sources():
    from flows.caching import ROOT
    from pipeline.config import SETTINGS_MODELS, Config

    config = Config(methods=_all_methods())
    for stage in load_stages().values():
        assert set(stage.settings_read(config)) <= set(SETTINGS_MODELS), stage.name
        assert all((ROOT / p).exists() for p in stage.code_paths()), (stage.name, stage.code_paths())
        assert all(f in Config.model_fields for f in stage.fields), stage.name
        assert stage.produces or stage.produces_per_method, stage.name


def test_every_stage_takes_an_empty_batch():
    """Edge case over every declaration: a batch without trajectories gives each stage's declared tables,
    empty (every method, so every stage runs)."""
    from tcpo_data import make_batch

    from pipeline.config import Config

    traj, steps = make_batch([])
    config = Config(methods=_all_methods())
    record: list[str] = []
    read = run_declared(config, traj, steps, record)
    assert set(read) == set(load_stages())


def test_settings_are_looked_up_by_their_model_class():
    """`config.settings(Model)` is the model's section of `stages:` (defaults where silent), typed as the
    model; `settings_named(name)` is the same object for code that holds only the name."""
    from pipeline.config import Config, ConfigError
    from pipeline.credit.methods.grpo import GRPOSettings

    assert GRPOSettings.settings_name == "grpo"
    config = Config(stages={"grpo": {"eps": 0.25}})
    s = config.settings(GRPOSettings)
    assert type(s) is GRPOSettings and s.eps == 0.25 and s.norm_by_std is True
    assert config.settings_named("grpo") == s
    assert Config().settings(GRPOSettings) == GRPOSettings()
    with pytest.raises(ConfigError, match="settings of stage 'grpo': eps"):
        Config(stages={"grpo": {"eps": "wide"}}).settings(GRPOSettings)
    with pytest.raises(ConfigError, match="unknown stage 'no_such'"):
        config.settings_named("no_such")


def test_an_unregistered_settings_class_is_refused():
    """A subclass of a registered model inherits `settings_name` but is not the registered class: reading
    it would validate the parent's section with another model."""
    from pipeline.config import Config
    from pipeline.credit.methods.grpo import GRPOSettings
    from pipeline.settings import StageSettings

    class Wider(GRPOSettings):
        pass

    class Loose(StageSettings):
        pass

    for model in (Wider, Loose):
        with pytest.raises(TypeError, match="not a registered settings model"):
            Config().settings(model)
