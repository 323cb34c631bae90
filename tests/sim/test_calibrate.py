"""`pdcluster sim calibrate`'s measured points (sim/calibrate.py), without a cluster."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sim.calibrate import POINTS, _random_point, chunk_features


def _record(cached: int, tpot_s: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(is_ok=True, cached_tokens=cached, completion_tokens=2, chunk_s=[1.0], tpot_s=tpot_s)


def test_a_point_records_its_cached_tokens() -> None:
    """The points' words share a prefix (one seed), so the prefill node serves the start of a longer point's prompt
    from its cache (the quiet run of 2026-12-05 23:34: 1,024 of ttft_w700's 3,518 tokens, 3,072 of ttft_w1200's
    6,018): the point records the mean cached tokens, and the fit prefills only the rest."""
    level = SimpleNamespace(num_ok=2, input_tokens=2 * 3518, ttft_ms=SimpleNamespace(p50=1500.0),
                            tpot_ms=SimpleNamespace(p50=None), records=[_record(1024), _record(2048)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]))
    point = next(p for p in POINTS if p.name == "ttft_w700")
    got = _random_point(real, point, Path("unused"))
    assert got["cached_tokens"] == 1536 and got["prompt_tokens"] == 3518
    steps, new_tokens, within, ctx = chunk_features(got["prompt_tokens"], None, got["cached_tokens"])
    assert (steps, new_tokens, within, ctx) == (1, 1982, 1982 * 1982 / 2, 1982 * 1536)


def test_a_tpot_point_is_the_mean_of_its_streams() -> None:
    """A stream's TPOT is its step time times the share of its steps between its first and last chunk, and
    `first_chunk_share` is that share's mean (0.815 for 33 tokens at text_token_p 0.147, where the median share is
    0.875): the point takes the mean of its streams' TPOTs, a stream of one chunk (TPOT 0) included, so that the
    fit's division gives the step back; the median (the level's p50) overstated it by 7% in expectation."""
    import pytest

    tpots = [0.0045, 0.0196, 0.0189, 0.0163]  # tpot_tp_b1_short of the calibration of 2026-12-06 00:53
    level = SimpleNamespace(num_ok=4, input_tokens=4 * 118, ttft_ms=SimpleNamespace(p50=280.0),
                            tpot_ms=SimpleNamespace(p50=17.6), records=[_record(0, t) for t in tpots])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]))
    point = next(p for p in POINTS if p.name == "tpot_tp_b1_short")
    assert _random_point(real, point, Path("unused"))["tpot_s"] == pytest.approx(sum(tpots) / 4, rel=1e-12)


def _shipped_measurement() -> dict:
    import json

    from sim.profile import PROFILE_DIR

    return json.loads((PROFILE_DIR / "cpu-mini-reference.measured.json").read_text())


NODE_FIGURES = ("step_s", "node_gaps", "step_rounds", "busy_share", "busy_share_rounds", "prefill_step_s",
                "prefill_step_rounds", "prefill_steps", "prefill_steps_rounds")
"""What a calibration reads from its nodes beside the client's figures (a measured.json from before had none)."""


def _client_only(measured: dict) -> dict:
    """The shipped measurement as a calibration without node figures would have recorded it."""
    return {name: {k: v for k, v in point.items() if k not in NODE_FIGURES} if isinstance(point, dict) else point
            for name, point in measured.items()}


def test_every_step_shares_its_core_evenly_and_the_beside_points_are_predictions() -> None:
    """Refit the shipped measurement without its node figures (its `*_beside_*` points moved 45-127% between rounds):
    every step's contention is time-sharing's 1.0 whatever they measured, and each is reported as a prediction: the
    point measured alone plus the stretching part once more (one more busy rank on the step's core). Doubling what a
    beside point measured changes no step."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import fit_profile
    from sim.profile import Profile

    config, measured = load_config(DEFAULT_CONFIG_PATH), _client_only(_shipped_measurement())
    fitted = Profile.model_validate(fit_profile(config, measured, "shared", "test"))
    assert [s.contention for s in fitted.steps] == [1.0, 1.0, 1.0]
    beside = {f.name: f for f in fitted.fit if "_beside_" in f.name}
    assert set(beside) == {"tpot_tp_beside_prefill", "ttft_beside_tp_decode", "tpot_dcp_beside_prefill"}
    assert not any(f.used_for_fit for f in beside.values())
    for name, alone in (("tpot_tp_beside_prefill", "tpot_tp_b1_short"), ("tpot_dcp_beside_prefill", "tpot_dcp_b1")):
        assert beside[name].modelled == pytest.approx(2.0 * measured[alone]["tpot_s"], rel=1e-12)
    p_step = fitted.step(2, 1)
    n = measured["ttft_w300"]["prompt_tokens"] - measured["ttft_w300"]["cached_tokens"]
    prefill_s = p_step.base_s + p_step.prefill_token_s * n + p_step.prefill_attn_s * n * n / 2
    assert beside["ttft_beside_tp_decode"].modelled == pytest.approx(measured["ttft_w300"]["ttft_s"] + prefill_s,
                                                                     rel=1e-12)
    measured["tpot_tp_beside_prefill"] = {**measured["tpot_tp_beside_prefill"],
                                          "tpot_s": 2.0 * measured["tpot_tp_beside_prefill"]["tpot_s"]}
    again = Profile.model_validate(fit_profile(config, measured, "shared", "test"))
    assert again.steps == fitted.steps


def test_attention_costs_one_price_per_query_key_pair() -> None:
    """Prefill points made by a model with 3e-8 s per attended (query, key) pair, cached or not, 4e-4 s per token
    and 0.05 s per request (after the per-step base): the fit gives them back, with prefill_attn_s equal to
    prefill_ctx_s, including for points whose new tokens follow a cached prefix."""
    import pytest

    from sim.calibrate import chunk_features, fit_prefill

    shapes = [(118, 0, None), (1518, 0, None), (3518, 1024, None), (6018, 3072, None), (4653, 3072, 256)]
    rows = [[1.0, *chunk_features(tokens, chunk, cached)] for tokens, cached, chunk in shapes]
    y = np.array([0.05 + 4e-4 * row[2] + 3e-8 * (row[3] + row[4]) for row in rows])
    const, per_token, attn, ctx = fit_prefill(rows, y, 1.0 / y)
    assert (const, per_token, attn, ctx) == pytest.approx((0.05, 4e-4, 3e-8, 3e-8), rel=1e-6)
    assert attn == ctx


def test_the_shipped_measurement_refits_with_one_attention_price() -> None:
    """The shipped measurement (no prompt prefilled from nothing past 1,518 tokens) fitted apart gave the P pool
    prefill_attn_s 0: every profile step now prices both attention terms alike."""
    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import fit_profile
    from sim.profile import Profile

    fitted = Profile.model_validate(fit_profile(load_config(DEFAULT_CONFIG_PATH), _shipped_measurement(), "p",
                                                "test"))
    assert all(s.prefill_attn_s == s.prefill_ctx_s > 0 for s in fitted.steps)


def test_tpot_points_record_their_output_and_older_ones_read_as_33() -> None:
    """A TPOT point records the output it asked for (TPOT_TOKENS, 97: a third of the first chunk's offset per
    step that 33 had), and the fit divides by that stream's share: the same measured TPOT read as 97 tokens or as
    a legacy point of 33 gives step costs in the ratio of the two shares."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import LEGACY_TPOT_TOKENS, TPOT_TOKENS, fit_profile, first_chunk_share, output_tokens
    from sim.profile import Profile

    level = SimpleNamespace(num_ok=1, input_tokens=118, ttft_ms=SimpleNamespace(p50=280.0),
                            tpot_ms=SimpleNamespace(p50=17.0), records=[_record(0, 0.017)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]))
    point = next(p for p in POINTS if p.name == "tpot_tp_b1_short")
    assert point.output == TPOT_TOKENS == 97
    assert output_tokens(_random_point(real, point, Path("unused"))) == 97
    assert output_tokens({}) == LEGACY_TPOT_TOKENS == 33
    names = ("tpot_dcp_b1", "tpot_dcp_b2")
    config, shipped = load_config(DEFAULT_CONFIG_PATH), _client_only(_shipped_measurement())
    # the DCP points as a calibration from before TPOT_TOKENS recorded them: no `output`, read as 33 tokens
    measured = {**shipped, **{k: {f: v for f, v in shipped[k].items() if f != "output"} for k in names}}
    legacy = Profile.model_validate(fit_profile(config, measured, "legacy", "test"))
    longer = {**measured, **{k: {**measured[k], "output": 97} for k in names}}
    fitted = Profile.model_validate(fit_profile(config, longer, "longer", "test"))
    text_p, first_p = legacy.stream.text_token_p, legacy.stream.first_token_p
    ratio = first_chunk_share(33, text_p, first_p=first_p) / first_chunk_share(97, text_p, first_p=first_p)
    entry = {f.name: f for f in fitted.fit}
    assert entry["tpot_dcp_b1"].modelled == pytest.approx(measured["tpot_dcp_b1"]["tpot_s"], rel=1e-9)
    assert fitted.step(1, 2).decode_ctx_s == legacy.step(1, 2).decode_ctx_s
    dcp_ctx = legacy.step(1, 2).decode_ctx_s
    for k, b in (("tpot_dcp_b1", 1), ("tpot_dcp_b2", 2)):  # base + seq*b: the step less its context part
        old = legacy.step(1, 2).base_s + legacy.step(1, 2).decode_seq_s * b
        new = fitted.step(1, 2).base_s + fitted.step(1, 2).decode_seq_s * b
        ctx_old = dcp_ctx * b * (measured[k]["prompt_tokens"] + 33 / 2)
        ctx_new = dcp_ctx * b * (measured[k]["prompt_tokens"] + 97 / 2)
        assert new + ctx_new == pytest.approx((old + ctx_old) * ratio, rel=1e-9)


def test_a_points_rounds_combine_to_the_median_round() -> None:
    """Three rounds of a point, the second disturbed (its TTFT a third longer, as ttft_w300 moved between the quiet
    calibrations of 2026-12-05): the point's TTFT is the median round's, token counts the median, chunk counts the
    sum (the stream model pools them), each round's TTFT kept; a single round is that round."""
    from sim.calibrate import combine_rounds

    rounds = [{"ttft_s": 1.00, "tpot_s": 0.020, "prompt_tokens": 1518, "cached_tokens": 0, "num_ok": 2,
               "later_chunks": 3, "later_tokens": 4},
              {"ttft_s": 1.33, "tpot_s": 0.024, "prompt_tokens": 1518, "cached_tokens": 512, "num_ok": 2,
               "later_chunks": 1, "later_tokens": 4},
              {"ttft_s": 0.98, "tpot_s": 0.019, "prompt_tokens": 1518, "cached_tokens": 0, "num_ok": 2,
               "later_chunks": 2, "later_tokens": 4}]
    got = combine_rounds(rounds)
    assert got == {"ttft_s": 1.00, "tpot_s": 0.020, "prompt_tokens": 1518, "cached_tokens": 0, "num_ok": 6,
                   "later_chunks": 6, "later_tokens": 12, "ttft_rounds": [1.00, 1.33, 0.98],
                   "tpot_rounds": [0.020, 0.024, 0.019]}
    assert combine_rounds(rounds[:1]) == {**rounds[0], "ttft_rounds": [1.00], "tpot_rounds": [0.020]}


def test_each_round_draws_its_own_words_and_the_median_round_wins(monkeypatch, tmp_path) -> None:
    """`run_points` on a stand-in cluster whose TTFTs depend on the words' seed: round r sends every point with its
    seed plus 100 r (no round finds another's prompts cached), and one disturbed round (+50%) moves no point."""
    import sim.measure
    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import COLOCATED, ROUND_SEED_STEP, run_points

    seeds: list[int] = []

    class Stand:
        def __init__(self, *args) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def warm_up(self, warmups, out_dir) -> None:
            pass

        def sweep(self, workload, scenario, levels, duration_s, out_dir, **kw):
            seed = workload.config.seed
            seeds.append(seed)
            slow = 1.5 if seed // ROUND_SEED_STEP == 1 else 1.0
            records = [SimpleNamespace(is_ok=True, cached_tokens=50, completion_tokens=2, chunk_s=[1.0],
                                       request_id="s.t1", ttft_s=slow, prompt_tokens=100, tpot_s=None)]
            level = SimpleNamespace(num_ok=1, input_tokens=100, ttft_ms=SimpleNamespace(p50=1000.0 * slow),
                                    tpot_ms=SimpleNamespace(p50=None), records=records)
            return SimpleNamespace(levels=[level])

    monkeypatch.setattr(sim.measure, "RealCluster", Stand)
    got = run_points(load_config(DEFAULT_CONFIG_PATH), ("ttft_w20",), tmp_path, rounds=3)
    assert set(got) == {"ttft_w20"} | {p.name for p in COLOCATED}
    assert got["ttft_w20"]["ttft_s"] == 1.0 and got["ttft_w20"]["ttft_rounds"] == [1.0, 1.5, 1.0]
    point_seeds = [s for s in seeds if s % ROUND_SEED_STEP == 7]  # ttft_w20 and colo_ttft_* (POINT_SEED 7)
    assert sorted(set(point_seeds)) == [7, 107, 207]


def test_the_fit_writes_each_points_rounds_and_their_spread() -> None:
    """A refit of the shipped measurement with ttft_w300's rounds: its fit entry carries them and their spread,
    (max - min) / median; a point of one round carries none."""
    import json

    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import fit_profile
    from sim.profile import PROFILE_DIR, Profile

    measured = json.loads((PROFILE_DIR / "cpu-mini-reference.measured.json").read_text())
    measured["ttft_w20"].pop("ttft_rounds", None)  # a point measured in one round (the shipped one has three)
    mid = measured["ttft_w300"]["ttft_s"]
    measured["ttft_w300"]["ttft_rounds"] = [0.8 * mid, mid, 1.3 * mid]
    fitted = Profile.model_validate(fit_profile(load_config(DEFAULT_CONFIG_PATH), measured, "rounds", "test"))
    entry = next(f for f in fitted.fit if f.name == "ttft_w300")
    assert entry.rounds == [0.8 * mid, mid, 1.3 * mid] and entry.spread == pytest.approx(0.5)
    assert next(f for f in fitted.fit if f.name == "ttft_w20").spread is None


def test_the_dcp_resume_point_fits_the_prefix_gather(capsys) -> None:
    """Refit the shipped measurement with a dcp_resume point made by the model itself (second turns of 7,163
    tokens, 6,656 of them cached: two chunks of at most 256 new tokens after 6,656 and 6,912, each step paying
    2e-5 s per token before its chunk, plus router, decode leg and, when the first token releases no text, a
    decode step): the fit gives back 2e-5 and models the point exactly; turns that found nothing cached leave it
    at 0 and say so."""
    import json

    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import DCP_RESUME, ROUTER_S, _resume_s, fit_profile
    from sim.profile import PROFILE_DIR, Profile, StepCost

    config = load_config(DEFAULT_CONFIG_PATH)
    measured = json.loads((PROFILE_DIR / "cpu-mini-reference.measured.json").read_text())
    measured.pop(DCP_RESUME.name, None)  # the shipped measurement's own point out: this test makes its own
    plain = fit_profile(config, measured, "plain", "test")
    step, first_p = plain["steps"][2], plain["stream"]["first_token_p"]
    point = {"prompt_tokens": 7163, "cached_tokens": 6656, "num_ok": 3, "later_chunks": 0, "later_tokens": 0}
    truth = StepCost.model_validate({**step, "prefill_prefix_s": 2e-5})
    engine_s = (truth.step_s(256, 6912) + truth.step_s(251, 7163)
                + (1 - first_p) * truth.step_s(batch=1, sum_context=7164))
    assert _resume_s(point, truth.model_dump(), first_p, 256) == pytest.approx(engine_s, rel=1e-12)
    point["ttft_s"] = ROUTER_S + plain["http"]["decode_leg_s"] + engine_s
    fitted = Profile.model_validate(fit_profile(config, {**measured, DCP_RESUME.name: point}, "resume", "test"))
    assert fitted.step(1, 2).prefill_prefix_s == pytest.approx(2e-5, rel=1e-9)
    assert fitted.step(1, 1).prefill_prefix_s == 0.0 and fitted.step(2, 1).prefill_prefix_s == 0.0
    entry = next(f for f in fitted.fit if f.name == DCP_RESUME.name)
    assert entry.modelled == pytest.approx(entry.measured, rel=1e-9)
    first = {"prompt_tokens": 7126, "cached_tokens": 0}  # the first turns: a prediction, 28 chunks from nothing
    point.update(first_ttft_s=8.0, first_prompt_tokens=7126)
    fitted = Profile.model_validate(fit_profile(config, {**measured, DCP_RESUME.name: point}, "resume", "test"))
    predicted = next(f for f in fitted.fit if f.name == DCP_RESUME.name + "_first_turn")
    assert not predicted.used_for_fit and predicted.measured == 8.0
    starts = sum(256 * k for k in range(28))
    assert predicted.modelled == pytest.approx(ROUTER_S + plain["http"]["decode_leg_s"] + _resume_s(
        first, step, first_p, 256) + 2e-5 * starts, rel=1e-9)
    cold = {**point, "cached_tokens": 0}
    again = Profile.model_validate(fit_profile(config, {**measured, DCP_RESUME.name: cold}, "cold", "test"))
    assert again.step(1, 2).prefill_prefix_s == 0.0
    assert "prefill_prefix_s not measured" in capsys.readouterr().err


def test_a_tpot_point_takes_its_decode_step_from_the_nodes_token_gaps() -> None:
    """A stand-in cluster whose decode node saw 4 streams of 97 tokens at 20 ms a round: 96 gaps each, the first
    about 0 (an imported stream's first token leaves with its second), 95 of 20 ms: the point's step is 20 ms,
    whatever the client's chunks said (its TPOT here: 5 ms), and a node without the histogram adds nothing."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import decode_node, node_step

    gaps = iter([(1.5, 40), (1.5 + 4 * 95 * 0.020 + 4 * 0.0001, 40 + 4 * 96)])
    level = SimpleNamespace(num_ok=4, input_tokens=4 * 118, ttft_ms=SimpleNamespace(p50=280.0),
                            tpot_ms=SimpleNamespace(p50=5.0), records=[_record(0, 0.005) for _ in range(4)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]),
                           token_gaps=lambda node: next(gaps))
    point = next(p for p in POINTS if p.name == "tpot_tp_b4_short")
    got = _random_point(real, point, Path("unused"), node="tp-0")
    assert got["step_s"] == pytest.approx(0.020, rel=1e-3) and got["node_gaps"] == 4 * 96
    assert node_step((2.0, 10), (2.0, 10), 1) == {}
    config = load_config(DEFAULT_CONFIG_PATH)
    assert [decode_node(config, n) for n in ("tpot_tp_b1_long", "tpot_dcp_b2", "tpot_dcp_beside_prefill",
                                             "ttft_w300")] == ["tp-0", "dcp-0", "dcp-0", None]


def test_node_steps_are_fitted_as_they_are() -> None:
    """TPOT points carrying node steps made by a known TP=1 decode step (12 ms + 4 ms per stream + 1e-6 s per
    context token) and DCP step (30 ms + 9 ms per stream + the TP pool's context cost / 2): the fit gives the
    costs back with no chunk share applied, and each fit entry is the node's step; points without node steps
    keep the client TPOT's path."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import fit_profile
    from sim.profile import Profile

    config, measured = load_config(DEFAULT_CONFIG_PATH), _shipped_measurement()
    shapes = {"tpot_tp_b1_short": 1, "tpot_tp_b4_short": 4, "tpot_tp_b1_long": 1}
    for k, b in shapes.items():
        context = b * (measured[k]["prompt_tokens"] + 97 / 2)
        measured[k] = {**measured[k], "output": 97, "step_s": 0.012 + 0.004 * b + 1e-6 * context}
    for k, b in (("tpot_dcp_b1", 1), ("tpot_dcp_b2", 2)):
        context = b * (measured[k]["prompt_tokens"] + 97 / 2)
        measured[k] = {**measured[k], "output": 97, "step_s": 0.030 + 0.009 * b + 0.5e-6 * context}
    fitted = Profile.model_validate(fit_profile(config, measured, "node", "test"))
    tp, dcp = fitted.step(1, 1), fitted.step(1, 2)
    assert (tp.base_s, tp.decode_seq_s, tp.decode_ctx_s) == pytest.approx((0.012, 0.004, 1e-6), rel=1e-6)
    assert (dcp.base_s, dcp.decode_seq_s, dcp.decode_ctx_s) == pytest.approx((0.030, 0.009, 0.5e-6), rel=1e-6)
    for entry in (f for f in fitted.fit if f.name in shapes):
        assert entry.source.startswith("Decode step") and entry.measured == measured[entry.name]["step_s"]
        assert entry.modelled == pytest.approx(entry.measured, rel=1e-6)


def test_contention_is_fitted_in_closed_form_from_node_figures() -> None:
    """A decode step of 20 ms alone that measures 20 * (1 + c * u) ms beside a P instance busy a share u of the
    point gives back c per round (beside = alone * (1 + c u), k = 2): three rounds made with c = 1.6, 1.8, 2.1 at
    u = 0.5, 0.4, 0.6; a figure missing, or u = 0, gives None (time-sharing kept)."""
    import pytest

    from sim.calibrate import fit_contention

    cs, us, alones = [1.6, 1.8, 2.1], [0.5, 0.4, 0.6], [0.020, 0.021, 0.019]
    beside = {"step_s": 0.0, "busy_share": 0.5, "step_rounds": [a * (1 + c * u) for a, c, u in zip(alones, cs, us)],
              "busy_share_rounds": us}
    assert fit_contention(beside, {"step_s": 0.02, "step_rounds": alones}) == pytest.approx(cs, rel=1e-12)
    one = {"step_s": 0.020 * (1 + 1.8 * 0.5), "busy_share": 0.5}
    assert fit_contention(one, {"step_s": 0.020}) == pytest.approx([1.8], rel=1e-12)
    assert fit_contention({**one, "busy_share": 0.0}, {"step_s": 0.020}) is None
    assert fit_contention({"step_s": 0.03}, {"step_s": 0.020}) is None
    assert fit_contention(one, {"tpot_s": 0.020}) is None
    assert fit_contention({**one, "step_s": 0.015}, {"step_s": 0.020}) == [0.0]
    # prefill steps: a round whose beside point counted more steps (the background's prefills) is left out, and a
    # kept round's background decoded throughout it (u = 1) unless the point measured its share
    prefill = {"prefill_step_rounds": [1.45, 1.3, 1.4], "prefill_steps_rounds": [2, 3, 2]}
    alone = {"prefill_step_rounds": [1.0, 1.0, 1.0], "prefill_steps_rounds": [2, 2, 2]}
    assert fit_contention(prefill, alone, "prefill_step_s", "prefill_steps") == pytest.approx([0.45, 0.4], rel=1e-12)
    assert fit_contention({**prefill, "busy_share_rounds": [0.5, 0.5, 0.8]}, alone, "prefill_step_s",
                          "prefill_steps") == pytest.approx([0.9, 0.5], rel=1e-12)
    assert fit_contention({**prefill, "prefill_steps_rounds": [3, 3, 3]}, alone, "prefill_step_s",
                          "prefill_steps") is None
    # with the background's step known (0.3 s), its time comes out of the round's sum: (1.3 * 3 - 0.3) / 2 = 1.8;
    # a round that counted fewer steps than alone is left out
    assert fit_contention(prefill, alone, "prefill_step_s", "prefill_steps", 0.3) == pytest.approx([0.45, 0.8, 0.4],
                                                                                                   rel=1e-12)
    assert fit_contention({**prefill, "prefill_steps_rounds": [2, 3, 1]}, alone, "prefill_step_s", "prefill_steps",
                          0.3) == pytest.approx([0.45, 0.8], rel=1e-12)


def _synthetic_rounds(measured: dict, rounds: int = 3) -> dict:
    """The shipped measurement as `rounds` rounds of a calibration with node figures (what `run_points` combines):
    every TPOT point with a node step 20 ms + 1e-6 s per prompt token, each beside point with a step made by
    contention 1.8 (TP) and 1.3 (DCP) at a busy share of 0.5, 0.4 and 0.6, and 0.45 (the P prefill: ttft_w300's 1 s
    prefill steps, two a round, beside a decode busy throughout), round r 5 % slower than round r - 1."""
    from sim.calibrate import combine_rounds

    made = {"tpot_tp_beside_prefill": ("tpot_tp_b1_short", 1.8), "tpot_dcp_beside_prefill": ("tpot_dcp_b1", 1.3),
            "ttft_beside_tp_decode": ("ttft_w300", 0.45)}
    shares = [0.5, 0.4, 0.6]
    out = {}
    for name, point in measured.items():
        got = []
        for r in range(rounds):
            slow = 1.05 ** r
            one = {k: v for k, v in point.items() if not k.endswith("_rounds")}
            if name in ("ttft_w300", "ttft_beside_tp_decode"):
                one.update(prefill_steps=2, prefill_step_s=slow * 1.0)
                if name in made:  # its background decodes throughout (u = 1: no busy share measured)
                    one["prefill_step_s"] *= 1 + made[name][1]
            if name.startswith("tpot_"):
                alone = made[name][0] if name in made else name
                one["output"] = 97
                one["step_s"] = slow * (0.020 + 1e-6 * measured[alone]["prompt_tokens"])
                if name in made:
                    one["step_s"] *= 1 + made[name][1] * shares[r]
                    one["busy_share"] = shares[r]
            got.append(one)
        out[name] = combine_rounds(got)
    return out


def test_a_calibration_with_node_figures_fits_each_decode_steps_contention() -> None:
    """A full calibration's points (every POINTS, BESIDE, COLOCATED and DCP_RESUME name, three rounds) with node
    figures: the P prefill, TP=1 and DCP decode steps get the contention their beside points were made with (0.45,
    1.8, 1.3, every round's kept with its spread, 0 here), the beside points are used for the fit and modelled as
    alone * (1 + c * u) (each figure its median round's); the profile validates. On the tree before fit_contention
    every step's contention was 1.0."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import ALL, BESIDE, COLOCATED, QUICK, fit_profile, prompt_tokens
    from sim.profile import Profile

    config, shipped = load_config(DEFAULT_CONFIG_PATH), _shipped_measurement()
    names = {*ALL, *(b.point.name for b in BESIDE), *(p.name for p in COLOCATED)}
    assert names == set(shipped)
    assert all(b.alone in ALL and b.alone in QUICK for b in BESIDE)
    measured = _synthetic_rounds(shipped)
    fitted = Profile.model_validate(fit_profile(config, measured, "node", "test"))
    assert [s.contention for s in fitted.steps] == pytest.approx([0.45, 1.8, 1.3], rel=1e-9)
    fit = {f.name: f for f in fitted.fit}
    alones = {"tpot_tp_beside_prefill": ("tpot_tp_b1_short", "step_s"), "tpot_dcp_beside_prefill": ("tpot_dcp_b1",
              "step_s"), "ttft_beside_tp_decode": ("ttft_w300", "prefill_step_s")}
    for name, c in (("tpot_tp_beside_prefill", 1.8), ("tpot_dcp_beside_prefill", 1.3), ("ttft_beside_tp_decode", 0.45)):
        assert fit[name + "_contention"].rounds == pytest.approx([c] * 3, rel=1e-9)
        assert fit[name + "_contention"].spread == pytest.approx(0.0, abs=1e-9)
        alone = measured[alones[name][0]][alones[name][1]]
        assert fit[name].used_for_fit and fit[name].modelled == pytest.approx(
            alone * (1 + c * measured[name].get("busy_share", 1.0)), rel=1e-9)
        assert len(fit[name].rounds) == 3
    # the background's own 20-word prompt prefilled among the point's steps, in every round: a third step of what
    # the fitted prefill gives for it; taken out, the same contention comes back (left out before, it was 1.0)
    p, n = fitted.steps[0], prompt_tokens(BESIDE[1].words)
    extra = p.base_s + p.prefill_token_s * n + p.prefill_attn_s * n * n / 2
    point = measured["ttft_beside_tp_decode"]
    with_background = {**point, "prefill_steps": 3, "prefill_steps_rounds": [3, 3, 3],
                       "prefill_step_s": (2 * point["prefill_step_s"] + extra) / 3,
                       "prefill_step_rounds": [(2 * b + extra) / 3 for b in point["prefill_step_rounds"]]}
    refit = Profile.model_validate(fit_profile(config, {**measured, "ttft_beside_tp_decode": with_background}, "node",
                                               "test"))
    assert refit.steps[0].contention == pytest.approx(0.45, rel=1e-9)
    assert {f.name: f for f in refit.fit}["ttft_beside_tp_decode"].measured == pytest.approx(point["prefill_step_s"],
                                                                                             rel=1e-9)
    del measured["ttft_beside_tp_decode"]["prefill_step_s"]
    del measured["ttft_beside_tp_decode"]["prefill_step_rounds"]
    again = Profile.model_validate(fit_profile(config, measured, "node", "test"))
    assert again.steps[0].contention == 1.0
    assert not {f.name: f for f in again.fit}["ttft_beside_tp_decode"].used_for_fit


def test_a_beside_point_records_how_busy_the_background_kept_its_instance() -> None:
    """A beside decode point reads the P node's prefill histogram before and after it: the point records that sum's
    growth over its wall time as `busy_share` (at most 1). The prefill point reads none (a decode node observes
    its token gaps as requests finish, so they say nothing of a shorter window)."""
    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import BESIDE, busy_node
    from sim.measure import PREFILL_SECONDS

    config = load_config(DEFAULT_CONFIG_PATH)
    assert [busy_node(config, b) for b in BESIDE] == [("prefill-0", PREFILL_SECONDS), None,
                                                      ("prefill-0", PREFILL_SECONDS)]
    asked, totals = [], iter([(3.0, 5), (3.0 + 1e6, 9)])
    level = SimpleNamespace(num_ok=2, input_tokens=2 * 118, ttft_ms=SimpleNamespace(p50=280.0),
                            tpot_ms=SimpleNamespace(p50=5.0), records=[_record(0, 0.005) for _ in range(2)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]),
                           token_gaps=lambda node: (0.0, 0),
                           node_totals=lambda node, name: asked.append((node, name)) or next(totals))
    point = next(p for p in POINTS if p.name == "tpot_tp_b1_short")
    got = _random_point(real, point, Path("unused"), node="tp-0", busy=("prefill-0", PREFILL_SECONDS))
    assert asked == [("prefill-0", PREFILL_SECONDS)] * 2 and got["busy_share"] == 1.0
    totals = iter([(3.0, 5), (3.0, 5)])
    assert _random_point(real, point, Path("unused"), node="tp-0",
                         busy=("prefill-0", PREFILL_SECONDS))["busy_share"] == 0.0


def test_the_prefill_beside_point_and_its_alone_point_record_the_p_nodes_prefill_steps() -> None:
    """ttft_w300 and ttft_beside_tp_decode read the P node's prefill histogram before and after them: two steps
    of 2.5 s in all give prefill_steps 2, prefill_step_s 1.25; other points read nothing."""
    import pytest

    from cluster.config import DEFAULT_CONFIG_PATH, load_config
    from sim.calibrate import POINTS, prefill_node
    from sim.measure import PREFILL_SECONDS

    config = load_config(DEFAULT_CONFIG_PATH)
    assert [prefill_node(config, n) for n in ("ttft_w300", "ttft_beside_tp_decode", "ttft_w20",
                                              "tpot_tp_beside_prefill")] == ["prefill-0", "prefill-0", None, None]
    asked, totals = [], iter([(3.0, 5), (5.5, 7)])
    level = SimpleNamespace(num_ok=2, input_tokens=2 * 1518, ttft_ms=SimpleNamespace(p50=1300.0),
                            tpot_ms=SimpleNamespace(p50=0.0), records=[_record(0) for _ in range(2)])
    real = SimpleNamespace(sweep=lambda *args, **kw: SimpleNamespace(levels=[level]),
                           node_totals=lambda node, name: asked.append((node, name)) or next(totals))
    point = next(p for p in POINTS if p.name == "ttft_w300")
    got = _random_point(real, point, Path("unused"), prefill="prefill-0")
    assert asked == [("prefill-0", PREFILL_SECONDS)] * 2
    assert got["prefill_steps"] == 2 and got["prefill_step_s"] == pytest.approx(1.25, rel=1e-12)
