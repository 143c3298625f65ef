"""The step-cost model (``engine.step_cost``): its features per arrangement,
known coefficients recovered from synthetic timings (with noise and
outliers), old evidence decaying, the prior keeping what traffic cannot tell
apart, and the recent prediction error."""

from __future__ import annotations

import numpy as np
import pytest

from diffrt.engine.step_cost import (
    FEATURES,
    Row,
    StepCostModel,
    reference_seconds,
    step_shape,
    tick_features,
)

TRUE = {"call": 4e-3, "token": 2e-5, "attention": 3e-9, "adapter_token": 5e-6,
        "tick": 6e-3, "encode": 2e-2, "decode": 1e-5}


def synthetic_ticks(rng, n: int, truth=TRUE):
    """Ticks of random rows and arrangements, their true seconds."""
    vector = np.array([truth[f] for f in FEATURES])
    for _ in range(n):
        rows = [Row(int(rng.integers(1, 3)), int(rng.choice([80, 272, 1040])),
                    bool(rng.random() < 0.3)) for _ in range(int(rng.integers(1, 4)))]
        shape = step_shape(rows, str(rng.choice(["by_size", "padded", "packed"])))
        features = tick_features(shape, int(rng.integers(1, 5)), int(rng.integers(0, 2)),
                                 float(rng.integers(0, 2) * 1040))
        yield features, float(vector @ features)


def test_features_follow_the_arrangement():
    rows = [Row(2, 100), Row(1, 300, adapters=True)]
    by_size, padded, packed = (step_shape(rows, a) for a in ("by_size", "padded", "packed"))
    assert (by_size.calls, by_size.tokens, by_size.attention) == (2, 500, 2 * 100**2 + 300**2)
    assert (padded.calls, padded.tokens, padded.attention) == (1, 900, 3 * 300**2)
    assert (packed.calls, packed.tokens) == (1, 500) and by_size.adapter_tokens == 300
    assert list(tick_features(by_size, steps=3, new=1, decoded_tokens=7)) == [
        6, 1500, 3 * by_size.attention, 900, 1, 1, 7]


def test_known_coefficients_are_recovered_through_noise_and_outliers():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for i, (features, seconds) in enumerate(synthetic_ticks(rng, 600)):
        seconds *= rng.normal(1.0, 0.03)
        if i % 20 == 7:
            seconds *= 4.0  # a tick another process slowed down
        model.observe(features, seconds)
    fitted = model.coefficients
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=0.15), name
    median, p90 = model.error()
    assert median < 0.05 and p90 < 0.3


def test_old_evidence_decays():
    """After the machine got twice as slow, the fit follows it."""
    rng = np.random.default_rng(1)
    model = StepCostModel()
    for features, seconds in synthetic_ticks(rng, 300):
        model.observe(features, seconds)
    slower = {name: 2 * value for name, value in TRUE.items()}
    for features, seconds in synthetic_ticks(rng, 1500, slower):
        model.observe(features, seconds)
    assert model.coefficients["token"] == pytest.approx(2 * TRUE["token"], rel=0.1)


def test_the_prior_holds_what_traffic_cannot_tell_apart():
    """Ticks of one size alone cannot tell a call's cost from its tokens':
    seeded with the calibration, the fit keeps the split and still predicts
    the size it measures."""
    model = StepCostModel(prior=TRUE)
    assert model.coefficients == pytest.approx(TRUE)  # calibrated before any tick
    one = tick_features(step_shape([Row(1, 272)], "by_size"), 1)
    truth = float(np.array([TRUE[f] for f in FEATURES]) @ one)
    for _ in range(100):
        model.observe(one, 1.5 * truth)  # a loaded machine
    assert model.predict(one) == pytest.approx(1.5 * truth, rel=0.05)
    assert model.coefficients["call"] > 0.5 * TRUE["call"]


def test_reference_seconds_compare_two_models():
    shapes = [step_shape([Row(1, 80)], "by_size"), step_shape([Row(2, 1040)], "by_size")]
    slower = {name: 2 * value for name, value in TRUE.items()}
    assert reference_seconds(slower, shapes) == pytest.approx(2 * reference_seconds(TRUE, shapes))


def test_the_flops_ratio_splits_a_slope_the_ticks_cannot():
    """Two sizes tell a step's fixed cost from one slope, not the linear term
    from the quadratic one: free, noise splits the slope by chance; held by
    the flops ratio, the split is the ratio's whatever the noise."""
    ratio = 1 / (6 * 32)
    truth = {**TRUE, "attention": TRUE["token"] * ratio}
    vector = np.array([truth[f] for f in FEATURES])
    splits: dict[float | None, list[float]] = {None: [], ratio: []}
    for seed in range(10):
        for pull, found in splits.items():
            rng, model = np.random.default_rng(seed), StepCostModel(attention_per_token=pull)
            for tokens in (528, 801):
                for new, decoded in ((1, 0.0), (0, float(tokens))):
                    features = tick_features(step_shape([Row(1, tokens)], "by_size"), 4, new,
                                             decoded)
                    model.observe(features, float(vector @ features) * rng.normal(1.0, 0.03))
            fitted = model.coefficients
            found.append(fitted["attention"] / fitted["token"] / ratio)
    assert max(splits[None]) - min(splits[None]) > 0.5  # by chance
    assert splits[ratio] == pytest.approx([1.0] * 10, rel=0.02)

def test_ticks_that_tell_the_terms_apart_outweigh_the_flops_ratio():
    """Where the ticks span sizes enough to measure attention's term, the fit
    follows them, not the ratio (a device where attention costs more, or
    less, per flop than the layers)."""
    truth = {**TRUE, "attention": 10 * TRUE["token"] / (6 * 32)}  # ten times the ratio
    model = StepCostModel(attention_per_token=1 / (6 * 32))
    vector = np.array([truth[f] for f in FEATURES])
    for _ in range(20):
        for tokens in (80, 1040, 4096, 16384):
            features = tick_features(step_shape([Row(1, tokens)], "by_size"), 2)
            model.observe(features, float(vector @ features))
    assert model.coefficients["attention"] == pytest.approx(truth["attention"], rel=0.1)


def test_a_refit_weighs_a_calibrations_ticks_against_the_fit_of_them_all():
    """Ticks of a calibration (three sizes) on a busy machine: the first
    one stalled ten times over. Weighed online, against fits of the ticks
    before each, the large size's ticks were discounted as outliers and the
    slope came out near 0 (a 2048² request priced like a small one);
    ``refit`` weighs them all against the fit of them all and finds it."""
    ratio = 1 / (6 * 32)
    truth = {**TRUE, "attention": TRUE["token"] * ratio}
    vector = np.array([truth[f] for f in FEATURES])
    far = tick_features(step_shape([Row(1, 16896)], "by_size"), 1)
    rng = np.random.default_rng(3)
    model = StepCostModel(attention_per_token=ratio)
    for i, (tokens, ticks) in enumerate(((528, 2), (801, 2), (1737, 6))):
        for tick in range(ticks):
            features = tick_features(step_shape([Row(1, tokens)], "by_size"), 4,
                                     int(tick == 0), float(tokens) * (tick == ticks - 1))
            stall = 10.0 if (i, tick) == (0, 0) else 1.0
            model.observe(features, float(vector @ features) * stall * rng.normal(1.0, 0.1))
    truth_far = float(vector @ far)
    assert model.predict(far) < 0.5 * truth_far  # online: the slope lost
    model.refit()
    assert model.predict(far) == pytest.approx(truth_far, rel=0.2)
