"""Next-interval predictors: exact answers where the model is a formula, trend-following where it is
statsmodels', and the fallbacks that keep a decision going when a fit cannot answer."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.planner.predictors import (
    ArimaPredictor,
    KalmanPredictor,
    LinearPredictor,
    make_predictor,
)


def fed(kind: str, values: list[float], history: int = 32):
    p = make_predictor(kind, history)  # type: ignore[arg-type]
    for v in values:
        p.add(v)
    return p


@pytest.mark.parametrize("kind", ["constant", "linear", "kalman", "arima"])
def test_no_history_is_zero_and_says_so(kind):
    p = make_predictor(kind, 8)
    assert p.predict() == 0.0
    assert p.last_fallback == "no history: 0"


def test_constant_is_the_last_value():
    p = fed("constant", [3.0, 9.0, 4.5])
    assert p.predict() == 4.5
    assert p.last_fallback is None


def test_linear_extrapolates_one_step():
    assert fed("linear", [2.0, 4.0, 6.0, 8.0]).predict() == pytest.approx(10.0)
    # least squares through (0,1) (1,2) (2,6): slope 2.5, intercept 0.5 -> at x=3: 8.0
    assert fed("linear", [1.0, 2.0, 6.0]).predict() == pytest.approx(8.0)


def test_history_keeps_only_the_newest_values():
    # with all ten points the line would be the same; a window of 3 on a kinked series differs
    p = fed("linear", [100.0] * 7 + [1.0, 2.0, 3.0], history=3)
    assert p.predict() == pytest.approx(4.0)


def test_linear_with_one_point_falls_back_to_it():
    p = fed("linear", [7.0])
    assert p.predict() == 7.0
    assert p.last_fallback == "1 of 2 points: last value"


def test_never_negative():
    assert fed("linear", [10.0, 5.0, 0.0]).predict() == 0.0  # the line says -5
    p = fed("constant", [-3.0])  # a negative observation is read as 0
    assert p.predict() == 0.0


def test_non_finite_values_are_skipped():
    p = fed("linear", [1.0, math.nan, 2.0, math.inf, 3.0])
    assert p.predict() == pytest.approx(4.0)


@pytest.mark.parametrize("kind", ["kalman", "arima"])
def test_models_need_eight_points(kind):
    p = fed(kind, [1.0, 2.0, 4.0, 3.0, 5.0])
    assert p.predict() == 5.0
    assert p.last_fallback == "5 of 8 points: last value"


@pytest.mark.parametrize("kind", ["kalman", "arima"])
def test_flat_series_is_its_value_without_a_fit(kind):
    p = fed(kind, [12.0] * 20)
    assert p.predict() == 12.0
    assert p.last_fallback is None


def rising(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 100.0 + 5.0 * np.arange(n) + rng.normal(0.0, 2.0, n)


@pytest.mark.parametrize("kind", ["linear", "kalman", "arima"])
def test_trend_followers_beat_constant_on_a_rising_series(kind):
    """Rolling one-step forecasts over a noisy line rising 5 per interval: constant lags by about
    the slope each time; the trend models must track it, and without falling back."""
    y = rising(40, seed=7)
    errors: dict[str, list[float]] = {"constant": [], kind: []}
    for name in errors:
        p = make_predictor(name, 16)  # type: ignore[arg-type]
        for t in range(len(y) - 1):
            p.add(float(y[t]))
            if t >= 15:
                forecast = p.predict()
                assert p.last_fallback is None, p.last_fallback
                assert math.isfinite(forecast) and forecast >= 0
                errors[name].append(abs(forecast - y[t + 1]))
    constant, model = float(np.mean(errors["constant"])), float(np.mean(errors[kind]))
    assert constant == pytest.approx(5.0, abs=1.5)
    assert model < 0.7 * constant, (model, constant)


@pytest.mark.parametrize("kind", ["kalman", "arima"])
def test_scale_does_not_matter(kind):
    """Hit rates (below 1) and request rates (thousands) are fitted on the standardized window."""
    y = rising(24, seed=3)
    big = fed(kind, list(y * 100.0)).predict()
    small = fed(kind, list(y / 1000.0)).predict()
    assert big / 100.0 == pytest.approx(small * 1000.0, rel=0.02)
    assert big / 100.0 == pytest.approx(100.0 + 5.0 * 24, abs=8.0)


@pytest.mark.parametrize("cls", [KalmanPredictor, ArimaPredictor])
def test_a_failing_fit_falls_back(monkeypatch, cls):
    def boom(self, z):
        raise np.linalg.LinAlgError("singular")
    monkeypatch.setattr(cls, "_fit_forecast", boom)
    p = cls(16)
    for v in rising(10, seed=1):
        p.add(float(v))
    assert p.predict() == pytest.approx(p.values[-1])
    assert p.last_fallback == f"{p.kind} fit failed (LinAlgError: singular): last value"


def test_a_warning_fit_falls_back_and_the_warning_stays_local(monkeypatch):
    from statsmodels.tools.sm_exceptions import ConvergenceWarning

    def warns(self, z):
        warnings.warn("Maximum Likelihood optimization failed to converge", ConvergenceWarning, stacklevel=1)
        return 123.0
    monkeypatch.setattr(KalmanPredictor, "_fit_forecast", warns)
    p = KalmanPredictor(16)
    for v in rising(10, seed=2):
        p.add(float(v))
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        assert p.predict() == pytest.approx(p.values[-1])
    assert outside == []  # caught inside predict(), not passed on
    assert warnings.filters == filters
    assert p.last_fallback is not None and "ConvergenceWarning" in p.last_fallback
    # the next good fit clears the note; its answer (in standard units) is scaled back
    monkeypatch.setattr(KalmanPredictor, "_fit_forecast", lambda self, z: 0.5)
    y = np.array(p.values)
    assert p.predict() == pytest.approx(y.mean() + 0.5 * y.std()) and p.last_fallback is None


def test_a_non_finite_forecast_falls_back(monkeypatch):
    monkeypatch.setattr(ArimaPredictor, "_fit_forecast", lambda self, z: math.nan)
    p = ArimaPredictor(16)
    for v in rising(10, seed=4):
        p.add(float(v))
    assert p.predict() == pytest.approx(p.values[-1])
    assert p.last_fallback == "arima forecast nan: last value"


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown predictor 'prophet'"):
        make_predictor("prophet", 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        make_predictor("constant", 0)
    assert isinstance(make_predictor("linear", 4), LinearPredictor)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["constant", "linear"]),
       st.lists(st.one_of(st.floats(min_value=-1e9, max_value=1e9), st.sampled_from([math.nan, math.inf, -math.inf])), max_size=40))
def test_formula_predictors_are_always_finite_and_non_negative(kind, values):
    p = fed(kind, values, history=16)
    out = p.predict()
    assert math.isfinite(out) and out >= 0


@pytest.mark.parametrize("kind", ["kalman", "arima"])
@pytest.mark.parametrize("seed", range(4))
def test_models_on_awkward_series_stay_finite(kind, seed):
    """Spikes, steps and sparse counts: whatever the fit does, the answer is usable."""
    rng = np.random.default_rng(seed)
    series = [np.r_[np.full(20, 10.0), 500.0], np.r_[np.zeros(10), np.full(10, 40.0)],
              rng.poisson(0.3, 24).astype(float), rng.lognormal(3, 1.5, 30)][seed]
    out = fed(kind, list(series)).predict()
    assert math.isfinite(out) and out >= 0
