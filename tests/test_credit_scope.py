"""Round-scope statistics (#22.5) and exact zeros (#22.6).

- The same round written with 1, 4 and 1000 groups per part and processed through the real flow
  (`run_process`: statistics pass, then credit) gives the same advantages for every method (<= 1e-6); the
  cache: a re-run is all cached, a re-written batch changes the round's statistics and recomputes every
  batch's credit (and matches a fresh lake).
- Pipeline level (hypothesis): any split of a round into batches, statistics pass + merge + credit, equals the
  round as one batch; `scope=batch` is the old behaviour (each batch whitened on its own).
- Every group-normalised method gives exactly 0 on groups whose rewards are all equal."""

from __future__ import annotations

import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from credit_rounds import random_round
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_flows_process import cfg_for

from pipeline.config import Config
from pipeline.credit.ops import Moments, group_normalize, whiten
from pipeline.credit.process import batch_statistics, merge_statistics, process_batch, statistics_table
from pipeline.synth import SynthSettings, generate
from warehouse.lake import Lake
from warehouse.rounds import read_batch, split_groups, write_round

# every estimator that needs no LLM (tcpo, tcpo_random_cf, tcpo_all_cf sample counterfactuals), and refiners
FLOW_METHODS = [
    "grpo",
    "dr_grpo",
    "rloo",
    "gdpo",
    "gae",
    "turn_ppo",
    "mt_grpo",
    "gigpo",
    "gae_pr",
    "grpo_pr",
    "tcpo_retro",
    "tcpo_retro_hin",
    "delta_reward",
    "turn_reward",
    "traj_reward",
    "gae+c3",
    "grpo+iapo",
]
FLOW_SETS = ["tcpo.missing_score=zero", "flow.processes=false"]


def run_process(cfg: Config, round_: int, quiet: bool = True) -> dict:
    """The round through the real flow (process_round_flow on the thread runner), as `creditflow process` runs
    it, without the terminal output."""
    from flows.process_round import process_round_flow

    state = process_round_flow(round_=round_, config=cfg, return_state=True)
    return {**state.result(), "state": state.name}


def synth_round(groups: int = 10, seed: int = 3) -> tuple[pa.Table, pa.Table]:
    return generate(SynthSettings(groups=groups, samples=4, turns=4, tokens=24, seed=seed, round=0))


def bump_rewards(traj: pa.Table, ids: set[str] | None = None) -> pa.Table:
    """Rewards + 5 on the trajectories `ids` (all when None)."""
    chosen = (
        pc.is_in(traj.column("traj_id"), pa.array(sorted(ids))) if ids else pc.is_valid(traj.column("reward"))
    )
    reward = pc.if_else(chosen, pc.add(traj.column("reward"), 5.0), traj.column("reward"))
    return traj.set_column(traj.schema.get_field_index("reward"), "reward", reward)


def token_advantages(lake: Lake) -> dict[str, dict[tuple[str, int], np.ndarray]]:
    adv = lake.read("advantages", 0).select(["method", "traj_id", "step_idx", "token_adv"])
    adv = adv.sort_by([("method", "ascending"), ("traj_id", "ascending"), ("step_idx", "ascending")])
    out: dict[str, dict] = {}
    for m, t, s, a in zip(*(adv.column(c).to_pylist() for c in adv.column_names), strict=True):
        out.setdefault(m, {})[(t, s)] = np.asarray(a, dtype=np.float64)
    return out


def assert_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b)
    for method in a:
        assert a[method].keys() == b[method].keys(), method
        worst = max(
            (float(np.max(np.abs(a[method][k] - b[method][k]), initial=0.0)) for k in a[method]), default=0.0
        )
        assert worst <= atol, f"{method}: token advantages differ by {worst:.3g}"


@pytest.mark.slow
def test_round_split_does_not_change_advantages_through_the_flow(tmp_path, prefect_harness):
    traj, steps = synth_round()
    results = {}
    for groups_per_part in (1, 4, 1000):
        lake = Lake(tmp_path / f"lake{groups_per_part}")
        parts = write_round(lake, 0, traj, steps, batch_groups=groups_per_part)
        assert len(parts) == {1: 10, 4: 3, 1000: 1}[groups_per_part]
        summary = run_process(cfg_for(lake, FLOW_METHODS, FLOW_SETS), 0, quiet=True)
        assert list(summary["this_run"])[-3:] == ["credit_stats", "credit", "export"]
        assert len(lake.parts("credit_stats", 0)) == len(parts)
        results[groups_per_part] = token_advantages(lake)
    for gpp in (4, 1000):
        assert_close(results[gpp], results[1])
    # gae's whitening really is over the round: with scope=batch the 1-group parts differ
    lake = Lake(tmp_path / "lake1")
    batch_scope = cfg_for(lake, ["gae"], [*FLOW_SETS, "gae.scope=batch"])
    run_process(batch_scope, 0, quiet=True)
    diff = [np.max(np.abs(a - results[1]["gae"][k])) for k, a in token_advantages(lake)["gae"].items()]
    assert max(diff) > 1e-3

    # cache: a re-run does no work; a re-written batch changes the round statistics, so every batch's credit
    # is recomputed, and the result is that of a fresh lake with the new rewards
    lake = Lake(tmp_path / "cache")
    write_round(lake, 0, traj, steps, batch_groups=4)
    cfg = cfg_for(lake, ["gae", "gdpo", "grpo"], FLOW_SETS)
    first = run_process(cfg, 0, quiet=True)["this_run"]
    again = run_process(cfg, 0, quiet=True)["this_run"]
    assert all(again[s]["cached"] == again[s]["batches"] == 3 for s in ("credit_stats", "credit", "export"))
    assert first["credit"]["batches"] == 3
    first = read_batch(lake, "trajectories", 0, "b00000")  # re-write one part with new rewards
    lake.write_part("trajectories", 0, bump_rewards(first), part="b00000")
    new_traj = bump_rewards(traj, set(first.column("traj_id").to_pylist()))
    changed = run_process(cfg, 0, quiet=True)["this_run"]
    assert changed["credit_stats"]["cached"] == 2  # only the re-written batch's statistics
    assert changed["credit"]["cached"] == 0  # the round's statistics changed: every batch
    fresh = Lake(tmp_path / "fresh")
    write_round(fresh, 0, new_traj, steps, batch_groups=1000)
    run_process(cfg_for(fresh, ["gae", "gdpo", "grpo"], FLOW_SETS), 0, quiet=True)
    assert_close(token_advantages(lake), token_advantages(fresh))


# ---- pipeline level ---------------------------------------------------------------------------------

SCOPED = ["gae", "turn_ppo", "gdpo", "gae_pr", "gae+c3"]
VARIANTS = [
    {},
    {"gae": {"lam": 0.9, "gamma": 0.95}, "gdpo": {"whiten": "tokens"}},
    {"turn_ppo": {"turn_reward": "verifier_score"}, "process_reward": {"level": "outcome"}},
]


def _split(traj: pa.Table, steps: pa.Table, batch_groups: int) -> list[tuple[pa.Table, pa.Table]]:
    return list(split_groups(traj, steps, batch_groups))


def _credit_by_batches(batches, methods, config, scope_round: bool = True):
    stats = None
    if scope_round:
        rows = [statistics_table(batch_statistics(t, s, methods, config)) for t, s in batches]
        stats = merge_statistics(pa.concat_tables(rows))
    tables = [process_batch(t, s, methods, config, round_stats=stats)[0] for t, s in batches]
    return {m: pa.concat_tables([tb[m] for tb in tables]) for m in methods}


def _per_step(tables: dict[str, pa.Table]) -> dict[str, dict]:
    out = {}
    for m, t in tables.items():
        cols = [t.column(c).to_pylist() for c in ("traj_id", "step_idx", "token_adv")]
        out[m] = {(i, s): np.asarray(a, dtype=np.float64) for i, s, a in zip(*cols, strict=True)}
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch_groups=st.integers(1, 3), variant=st.sampled_from(VARIANTS))
def test_any_split_equals_the_whole_round(seed, batch_groups, variant):
    traj, steps = random_round(seed, max_groups=6, max_group_size=4, max_steps=6)
    config = Config(methods=SCOPED, stages=variant)
    whole = _per_step(process_batch(traj, steps, SCOPED, config)[0])
    split = _per_step(_credit_by_batches(_split(traj, steps, batch_groups), SCOPED, config))
    assert_close(split, whole, atol=1e-6)  # the advantages table holds float32


def _renamed_components(traj: pa.Table, rename: dict[str, str], without: set[str]) -> pa.Table:
    """The trajectories with their components renamed (`rename`; to "": left out), and none on the groups
    `without`."""
    rows = traj.to_pylist()
    for row in rows:
        comps = row["reward_components"]
        if row["group_id"] in without:
            row["reward_components"] = None
        elif comps is not None:
            row["reward_components"] = [(rename.get(k, k), v) for k, v in comps if rename.get(k, k)]
    return pa.Table.from_pylist(rows, schema=traj.schema)


def _gdpo_round(batches, config, keep: bool = True) -> tuple[pa.Table, int]:
    """GDPO on the round as one process runs it: with the statistics pass's batches kept for credit
    (`keeping_credit_batches`), or each pass building its own (`keep=False`). Its advantages, and how often
    Eq. 1-2 were computed."""
    import pipeline.credit.methods.gdpo as gdpo_method
    from pipeline.credit.process import forget_credit_batches, keeping_credit_batches

    calls = []
    real = gdpo_method._gdpo_pre

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    gdpo_method._gdpo_pre = counted
    try:
        with keeping_credit_batches() if keep else contextlib.nullcontext():
            rows = [statistics_table(batch_statistics(t, s, ["gdpo"], config)) for t, s in batches]
        stats = merge_statistics(pa.concat_tables(rows))
        tables = [process_batch(t, s, ["gdpo"], config, round_stats=stats)[0] for t, s in batches]
    finally:
        gdpo_method._gdpo_pre = real
        forget_credit_batches()
    return pa.concat_tables([tb["gdpo"] for tb in tables]), len(calls)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batch_groups=st.integers(1, 3),
    rename=st.sampled_from(
        [{}, {"acc": "reward"}, {"acc": "reward", "fmt": ""}, {"acc": "reward", "fmt": "z"}]
    ),
    bare=st.sampled_from([set(), {"g0"}, {"g0", "g2"}]),
    whiten=st.sampled_from(["trajectories", "tokens", "none"]),
)
def test_gdpo_on_a_kept_batch_equals_its_recompute(seed, batch_groups, rename, bare, whiten):
    """GDPO's Eq. 1-2 of the statistics pass, kept with its batch, serve credit only where credit's components
    are the batch's own: a batch without components (its stand-in "reward", from R) beside batches with a
    component named "reward" (R^c: zeros on that batch) gets what it gets when credit computes it again."""
    traj, steps = random_round(seed, max_groups=4, max_group_size=4, max_steps=5)
    traj = _renamed_components(traj, rename, bare)
    config = Config(methods=["gdpo"], stages={"gdpo": {"whiten": whiten}})
    batches = _split(traj, steps, batch_groups)
    got, _ = _gdpo_round(batches, config)
    want, _ = _gdpo_round(batches, config, keep=False)
    assert got.num_rows == want.num_rows == steps.num_rows
    assert got.select(["traj_id", "step_idx"]).equals(want.select(["traj_id", "step_idx"]))
    assert got.column("token_adv").equals(want.column("token_adv"))


def test_gdpo_computes_eq_1_2_once_per_kept_batch():
    """Every batch with the round's components: the statistics pass's Eq. 1-2 are credit's (one computation a
    batch); the recompute path computes them in both passes."""
    traj, steps = random_round(5, max_groups=6, max_group_size=4, max_steps=5, components=False)
    kind = traj.schema.field("reward_components").type
    comps = pa.array([[("acc", float(i % 3)), ("fmt", 1.0)] for i in range(traj.num_rows)], kind)
    traj = traj.set_column(traj.schema.get_field_index("reward_components"), "reward_components", comps)
    config = Config(methods=["gdpo"])
    batches = _split(traj, steps, 2)
    assert len(batches) > 1
    got, calls = _gdpo_round(batches, config)
    want, recomputed = _gdpo_round(batches, config, keep=False)
    assert (calls, recomputed) == (len(batches), 2 * len(batches))
    assert got.equals(want)


def test_scope_batch_whitens_each_batch_on_its_own():
    traj, steps = random_round(11, max_groups=6, max_group_size=4, max_steps=6)
    sets = {m: {"scope": "batch"} for m in ("gae", "turn_ppo", "gdpo")}
    config = Config(methods=SCOPED, stages=sets)
    batches = _split(traj, steps, 2)
    assert len(batches) > 1
    # scope=batch: the statistics pass has nothing to do, and each batch is its own round
    assert batch_statistics(*batches[0], SCOPED, config) == {}
    by_batch = _per_step(_credit_by_batches(batches, SCOPED, config, scope_round=False))
    alone = _per_step(
        {m: pa.concat_tables([process_batch(t, s, [m], config)[0][m] for t, s in batches]) for m in SCOPED}
    )
    assert_close(by_batch, alone, atol=0.0)


def test_moments_merge_exactly_in_any_order():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, 1000)
    w = rng.integers(1, 9, 1000).astype(float)
    whole = Moments.of(x, w)
    for cuts in ([500], [1, 2, 999], list(range(10, 1000, 10))):
        parts = [Moments.of(a, b) for a, b in zip(np.split(x, cuts), np.split(w, cuts), strict=True)]
        for order in (parts, parts[::-1]):
            m = Moments.merged(order)
            assert m.n == whole.n
            assert abs(m.mean - whole.mean) < 1e-12 and abs(m.m2 - whole.m2) < 1e-8 * whole.m2
    # a constant sample whitens to exactly 0, merged or not
    c = np.full(7, 0.1)
    assert not whiten(c).any()
    assert not whiten(c, Moments.merged([Moments.of(c[:3]), Moments.of(c[3:])])).any()


# ---- exactly 0 on constant groups (spec 7 and 9) ---------------------------------------------------------

GROUP_NORMALISED = ["grpo", "dr_grpo", "rloo", "gdpo", "mt_grpo", "gigpo", "grpo_pr", "grpo+iapo"]
# the settings under which each method's advantage is its group-normalised outcome term alone: GDPO without
# its batch whitening (a shift by the batch mean), MT-GRPO without a turn reward, GiGPO without the step term
ZERO_SETS = {
    "gdpo": {"whiten": "none"},
    "mt_grpo": {"turn_reward": "component:absent"},
    "gigpo": {"step_advantage_w": 0.0},
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    value=st.sampled_from([0.1, 0.7, 1 / 3, 1e-3, 123.456, -0.3]),
    size=st.integers(2, 9),
    whole_batch=st.booleans(),
)
def test_constant_reward_groups_give_exactly_zero(seed, value, size, whole_batch):
    traj, steps = generate(SynthSettings(groups=3, samples=size, turns=3, tokens=8, seed=seed, round=0))
    # one group (or every group) holds `size` copies of the same reward; the others keep theirs
    g0 = traj.column("group_id")[0]
    const = pc.equal(traj.column("group_id"), g0) if not whole_batch else pc.is_valid(traj.column("reward"))
    traj = traj.set_column(
        traj.schema.get_field_index("reward"), "reward", pc.if_else(const, value, traj.column("reward"))
    )
    rc = traj.schema.get_field_index("reward_components")  # GDPO then normalises the reward (one component)
    traj = traj.set_column(rc, traj.schema.field(rc), pa.nulls(traj.num_rows, traj.schema.field(rc).type))
    members = pa.array(sorted(pc.filter(traj.column("traj_id"), const).to_pylist()))
    tables, _ = process_batch(traj, steps, GROUP_NORMALISED, Config(stages=ZERO_SETS))
    for method, t in tables.items():
        rows = t.filter(pc.is_in(t.column("traj_id"), members))
        flat = pc.list_flatten(rows.column("token_adv")).to_numpy(zero_copy_only=False)
        assert len(flat) and not flat.any(), f"{method}: {np.abs(flat).max():.3g} on a constant group"


@given(
    value=st.floats(-1e6, 1e6, allow_nan=False),
    n=st.integers(2, 50),
    norm_by_std=st.booleans(),
    singleton=st.sampled_from(["verl", "zero", "keep"]),
)
def test_group_normalize_constant_is_zero(value, n, norm_by_std, singleton):
    groups = np.repeat([0, 1], n)
    x = np.concatenate([np.full(n, value), np.linspace(0, 1, n)])
    out = group_normalize(x, groups, norm_by_std=norm_by_std, singleton=singleton)
    assert not out[:n].any()
    weighted = group_normalize(x, groups, weights=np.arange(1, 2 * n + 1), ddof=0, singleton=singleton)
    assert not weighted[:n].any()


def test_plain_credit_batch_keeps_round_statistics_current(tmp_path):
    """Without the flow: the credit stage makes the statistics parts it lacks, and remakes a part whose batch
    changed since (its `source`), so a re-written part changes every batch's whitening."""
    from flows.batch import round_batches, run_stage
    from pipeline.stages import get_stage

    credit = get_stage("credit")

    traj, steps = synth_round(groups=6)
    lake, fresh = Lake(tmp_path / "lake"), Lake(tmp_path / "fresh")
    write_round(lake, 0, traj, steps, batch_groups=2)
    cfg = Config(lake=str(lake.root), methods=["gae", "gdpo"])
    for b in round_batches(lake, 0):
        run_stage(lake, 0, b, credit, cfg)
    assert len(lake.parts("credit_stats", 0)) == 3
    before = token_advantages(lake)
    first = read_batch(lake, "trajectories", 0, "b00000")
    lake.write_part("trajectories", 0, bump_rewards(first), part="b00000")
    for b in round_batches(lake, 0):
        run_stage(lake, 0, b, credit, cfg)
    write_round(fresh, 0, bump_rewards(traj, set(first.column("traj_id").to_pylist())), steps, batch_groups=6)
    fresh_cfg = Config(lake=str(fresh.root), methods=["gae", "gdpo"])
    run_stage(fresh, 0, "b00000", credit, fresh_cfg)
    after = token_advantages(lake)
    assert_close(after, token_advantages(fresh))
    # every batch changed, not only the re-written one: the round's mean and variance moved
    last = [k for k in after["gae"] if k[0] not in set(first.column("traj_id").to_pylist())]
    assert max(float(np.max(np.abs(after["gae"][k] - before["gae"][k]), initial=0.0)) for k in last) > 1e-3


# ---- a statistics pass without tokens (#36) ---------------------------------------------------------------


def _settings_variants(model) -> list[dict]:
    """The defaults, and each Literal / bool field of a settings model set to each of its other values."""
    import typing

    out: list[dict] = [{}]
    for name, f in model.model_fields.items():
        ann = f.annotation
        choices = list(typing.get_args(ann)) if typing.get_origin(ann) is typing.Literal else []
        choices += [True, False] if ann is bool else []
        out += [{name: c} for c in choices if c != f.default]
    return out


def _stat_cases() -> list[tuple[str, dict]]:
    from pipeline.credit.registry import ESTIMATORS
    from pipeline.settings import SETTINGS_MODELS

    Config(methods=["gdpo"]).settings_named("gdpo")  # every stage module registered
    return [
        (name, variant)
        for name, est in sorted(ESTIMATORS.items())
        if est.statistics is not None
        for variant in _settings_variants(SETTINGS_MODELS[est.statistics.settings])
    ]


def test_every_estimator_with_a_statistic_has_cases():
    names = {name for name, _ in _stat_cases()}
    assert {"gae", "gdpo", "turn_ppo"} <= names
    assert ("gdpo", {"whiten": "tokens"}) in _stat_cases()


def test_no_statistics_pass_without_a_statistic():
    """Without whitening gae, gae_pr and turn_ppo take no round statistic: no statistics pass reads the round
    for them. GDPO without whitening still learns the round's component names in it (no tokens read)."""
    from pipeline.credit.process import statistics_methods
    from pipeline.credit.registry import statistics_step_columns

    off = {"gae": {"whiten": False}, "turn_ppo": {"whiten": False}, "gdpo": {"whiten": "none"}}
    for method in ("gae", "gae_pr", "turn_ppo"):
        assert statistics_methods(Config(methods=[method])) == [method]
        assert statistics_methods(Config(methods=[method], stages=off)) == []
    assert statistics_methods(Config(methods=["gdpo", "gae"], stages=off)) == ["gdpo"]
    assert "n_tokens" not in statistics_step_columns(["gdpo"], Config(methods=["gdpo"], stages=off))
    # GDPO whitening over trajectories reads no steps at all (its batch: the trajectories); over tokens, the
    # steps' keys and token counts; with gae beside it, gae's columns
    assert statistics_step_columns(["gdpo"], Config(methods=["gdpo"])) == []
    tokens = Config(methods=["gdpo"], stages={"gdpo": {"whiten": "tokens"}})
    assert statistics_step_columns(["gdpo"], tokens) == ["traj_id", "step_idx", "role", "n_tokens"]
    assert "values_mean" in statistics_step_columns(["gdpo", "gae"], Config(methods=["gdpo", "gae"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), case=st.sampled_from(_stat_cases()))
def test_a_statistic_reads_no_more_than_it_declares(seed, case):
    """Each statistic's declarations (`RoundStatistics.active`, `.tokens`) hold against its function on full
    batches. Inactive under its settings: it takes nothing, and no statistics pass runs for it. Declaring no
    tokens: its moments on a batch built without `token_ids` (what the statistics pass then reads) are those of
    the full batch; the pass's columns leave `token_ids` out exactly then, and keep it when another statistic of
    the pass reads tokens."""
    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.process import statistics_methods
    from pipeline.credit.registry import ESTIMATORS, statistics_step_columns

    name, variant = case
    est = ESTIMATORS[name]
    stat = est.statistics
    config = Config(methods=[name], stages={stat.settings: variant})
    own = config.settings_named(stat.settings)  # what the declarations read (the statistic's scope model)
    fn_settings = config.settings_named(est.settings) if est.settings else None  # what `fn` is given
    traj, steps = random_round(seed, max_groups=5, max_group_size=4, max_steps=5)
    full = stat.fn(CreditBatch.from_arrow(traj, steps, None, config=config), fn_settings)
    round_scope = getattr(own, "scope", "round") == "round"
    assert statistics_methods(config) == ([name] if round_scope and stat.active(own) else [])
    if not stat.active(own):
        assert full == {}
        return
    columns = statistics_step_columns([name], config)
    assert ("n_tokens" in columns) == stat.tokens(own)
    assert "n_tokens" in statistics_step_columns([name, "gae"], config)  # gae's whitening reads tokens
    if stat.tokens(own):
        return
    bare = CreditBatch.from_arrow(traj, steps.select(columns), columns, config=config, tokens=False)
    assert bare.n_tokens == 0
    got = stat.fn(bare, fn_settings)
    assert got.keys() == full.keys()
    for key, m in full.items():
        assert (got[key].n, got[key].mean, got[key].m2) == pytest.approx(
            (m.n, m.mean, m.m2), rel=1e-12, abs=1e-12
        )
    # the statistics pass on the steps it reads gives the moments it gives on the whole table
    assert batch_statistics(traj, steps.select(columns), [name], config) == batch_statistics(
        traj, steps, [name], config
    )


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_statistics_pass_without_tokens_through_the_lake(tmp_path, monkeypatch, fmt):
    """GDPO alone (whitening over trajectories: a statistics pass that reads no token_ids) through the plain
    credit stage on a lake of 3 batches gives the advantages of the round as one batch; its run-log rows say it
    read no tokens, credit's say the batch's."""
    from flows.batch import round_batches, run_stage
    from pipeline.stages import get_stage
    from warehouse.lake import FORMAT_ENV
    from warehouse.runlog import read_stage_runs

    monkeypatch.setenv(FORMAT_ENV, fmt)
    traj, steps = synth_round(groups=6)
    lake, whole = Lake(tmp_path / "lake"), Lake(tmp_path / "whole")
    write_round(lake, 0, traj, steps, batch_groups=2)
    write_round(whole, 0, traj, steps, batch_groups=6)
    for target in (lake, whole):
        cfg = Config(lake=str(target.root), methods=["gdpo"])
        for b in round_batches(target, 0):
            run_stage(target, 0, b, get_stage("credit"), cfg)
    assert_close(token_advantages(lake), token_advantages(whole))
    runs = read_stage_runs(lake, 0).to_pylist()  # (Delta: the spooled rows too)
    assert {r["tokens"] for r in runs if r["stage"] == "credit_stats"} == {0}
    assert sum(r["tokens"] for r in runs if r["stage"] == "credit") == sum(
        len(t) for t in steps["token_ids"].to_pylist()
    )


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_statistics_pass_gives_the_moments_its_parts_hold(tmp_path, monkeypatch, fmt):
    """`round_statistics` merges what the statistics pass wrote without reading it back (#36): the same
    moments, bit for bit, as a later call that reads every (now current) part from the lake, and the parts hold
    the rows the pass computed."""
    from flows.batch import round_batches, round_statistics
    from warehouse.lake import FORMAT_ENV

    monkeypatch.setenv(FORMAT_ENV, fmt)
    traj, steps = synth_round(groups=6)
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, traj, steps, batch_groups=2)
    cfg = Config(lake=str(lake.root), methods=["gae", "gdpo"])
    batches = round_batches(lake, 0)
    made = round_statistics(lake, 0, cfg, batches)
    assert all(read_batch(lake, "credit_stats", 0, b).num_rows for b in batches)
    stored = round_statistics(lake, 0, cfg, batches)  # every part current: read from the lake
    assert made and made == stored
    by_batch = [
        batch_statistics(
            read_batch(lake, "trajectories", 0, b), read_batch(lake, "steps", 0, b), ["gae", "gdpo"], cfg
        )
        for b in batches
    ]
    assert merge_statistics(pa.concat_tables([statistics_table(s) for s in by_batch])) == made


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_plain_statistics_pass_writes_the_round_at_once(tmp_path, monkeypatch, fmt):
    """A plain caller's statistics pass over the batches without a current part (#36) writes their parts in
    one `write_parts` (one Delta commit for the round, not one per batch), each batch's part as the stage
    computes it on that batch (source = the stage's cache key, so a later call finds it current), and a
    run-log row per batch with that key; a batch whose part is current is neither recomputed nor logged again."""
    import flows.batch as fb
    from flows.caching import stage_cache_key
    from pipeline.stages import get_stage
    from warehouse.lake import FORMAT_ENV
    from warehouse.runlog import read_stage_runs

    monkeypatch.setenv(FORMAT_ENV, fmt)
    traj, steps = synth_round(groups=8)
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, traj, steps, batch_groups=2)
    cfg = Config(lake=str(lake.root), methods=["gae", "gdpo"])
    batches = fb.round_batches(lake, 0)
    assert len(batches) == 4
    stage = get_stage("credit_stats")
    fb.run_stage(lake, 0, batches[0], stage, cfg, stage_cache_key(lake.uri, 0, batches[0], stage, cfg))
    writes: list[tuple[str, list[str]]] = []
    real = type(lake).write_parts

    def counted(self, table, round_, parts):
        writes.append((table, sorted(parts)))
        return real(self, table, round_, parts)

    monkeypatch.setattr(type(lake), "write_parts", counted)
    commits = len(list((lake.root / "credit_stats" / "_delta_log").glob("*.json")))
    made = fb.round_statistics(lake, 0, cfg, batches)
    assert ("credit_stats", batches[1:]) in writes
    assert [t for t, _ in writes].count("credit_stats") == 1
    if fmt == "delta":
        assert len(list((lake.root / "credit_stats" / "_delta_log").glob("*.json"))) == commits + 1
    for b in batches:
        part = read_batch(lake, "credit_stats", 0, b)
        key = stage_cache_key(lake.uri, 0, b, stage, cfg)
        assert set(part.column("source").to_pylist()) == {key}
        alone = batch_statistics(
            read_batch(lake, "trajectories", 0, b), read_batch(lake, "steps", 0, b), ["gae", "gdpo"], cfg
        )
        assert merge_statistics(part) == alone
    runs = [r for r in read_stage_runs(lake, 0).to_pylist() if r["stage"] == "credit_stats"]
    assert sorted(r["batch"] for r in runs) == batches
    assert all(r["cache_key"] == stage_cache_key(lake.uri, 0, r["batch"], stage, cfg) for r in runs)
    rows = {b: read_batch(lake, "credit_stats", 0, b).num_rows for b in batches}
    assert all(r["seconds"] > 0 and r["rows_out"] == [("credit_stats", rows[r["batch"]])] for r in runs)
    writes.clear()
    assert fb.round_statistics(lake, 0, cfg, batches) == made  # every part current: nothing written
    assert writes == []


def test_a_plain_statistics_pass_holds_no_batch_read_until_its_write(tmp_path, monkeypatch):
    """The statistics pass over several batches (one write for all of them, #36) keeps only each batch's few
    rows of moments until the write: with the kept reads off (the default budget) no table a batch's pass read
    is alive when the parts are written, so its memory does not grow with the round (gae at lam < 1 reads
    every token's value)."""
    import gc
    import weakref

    import flows.batch as fb

    traj, steps = synth_round(groups=8)
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, traj, steps, batch_groups=2)
    cfg = Config(lake=str(lake.root), methods=["gae"], stages={"gae": {"lam": 0.9}})
    reads: list[weakref.ref] = []
    real_read, real_write = fb._read, type(lake).write_parts
    monkeypatch.setattr(
        fb, "_read", lambda *a, **k: (t := real_read(*a, **k), reads.append(weakref.ref(t)))[0]
    )
    alive: list[int] = []

    def write(self, table, round_, parts):
        if table == "credit_stats":
            gc.collect()
            alive.append(sum(r() is not None for r in reads))
        return real_write(self, table, round_, parts)

    monkeypatch.setattr(type(lake), "write_parts", write)
    assert fb.round_statistics(lake, 0, cfg)
    assert len(reads) == 8 and alive == [0]


def test_a_plain_statistics_pass_names_the_batch_it_failed_on(tmp_path):
    """A batch whose statistics cannot be taken (an assistant step without critic values, gae) fails the plain
    statistics pass with the estimator's error naming the trajectory, and the batch it was in: the CLI's one
    error line says `stage credit_stats on batch ...` (flows.cli.error_line); no part is written (the pass
    writes every batch's part at once, after the last)."""
    import flows.batch as fb
    from flows.cli import error_line
    from pipeline.credit.registry import MethodError

    traj, steps = synth_round(groups=6)
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, traj, steps, batch_groups=2)
    batches = fb.round_batches(lake, 0)
    bad_batch = batches[1]
    part = read_batch(lake, "steps", 0, bad_batch)
    rows = part.to_pylist()
    victim = next(r for r in rows if r["role"] == "assistant" and r["values"])
    victim["values"] = [None] * len(victim["values"])
    lake.write_part("steps", 0, pa.Table.from_pylist(rows, schema=part.schema), part=bad_batch)
    cfg = Config(lake=str(lake.root), methods=["gae"])
    with pytest.raises(MethodError, match=victim["traj_id"]) as info:
        fb.round_statistics(lake, 0, cfg, batches)
    line = error_line(info.value)
    assert line.startswith(f"error: stage credit_stats on batch {bad_batch} failed: "), line
    assert victim["traj_id"] in line
    assert not any(read_batch(lake, "credit_stats", 0, b).num_rows for b in batches)
