"""Next-interval forecasts of one observed series (request rate, ISL, OSL, KV hit rate).

``make_predictor(kind, history)`` builds one; ``add`` feeds it an interval's value, ``predict`` answers
the next interval's (finite, never negative). The models are statsmodels' (a kept library rather than
hand-rolled statistics) except the two that need none:

- ``constant``: the last value.
- ``linear``: a least-squares line over the window (``numpy.polyfit``), one step ahead.
- ``kalman``: statsmodels' ``UnobservedComponents`` local linear trend (a Kalman filter over a level
  and a slope whose noise variances are fitted by maximum likelihood), one-step forecast.
- ``arima``: statsmodels' ``ARIMA(0,1,1)`` with drift, one-step forecast: exponential smoothing of
  the level plus a constant trend. (1,1,1) forecast no better on the series we tried and took twice
  as long to fit (and Hannan-Rissanen, the fast estimator, failed on half of them).

A model predictor with fewer than ``min_points`` values, or whose fit raises, warns (non-convergence)
or answers NaN/inf, answers the last value instead (0.0 before any value) and says why in
``last_fallback``; a flat window answers its value without fitting (every model forecasts a constant
series as itself, and the MLE fits degenerate on zero variance).
"""

from __future__ import annotations

import abc
import math
import warnings
from collections import deque
from typing import Any, Literal, Protocol

import numpy as np

PredictorKind = Literal["constant", "linear", "kalman", "arima"]
KINDS: tuple[PredictorKind, ...] = ("constant", "linear", "kalman", "arima")

ARIMA_ORDER = (0, 1, 1)


class Predictor(Protocol):
    kind: PredictorKind
    last_fallback: str | None  # why the last predict() answered the last value instead of the model's

    def add(self, value: float) -> None: ...

    def predict(self) -> float: ...


class _Window(abc.ABC):
    """Keeps the newest ``history`` values; subclasses forecast from them (``_forecast``)."""

    kind: PredictorKind
    min_points = 1  # fewer values than this: the last value

    def __init__(self, history: int) -> None:
        if history < 1:
            raise ValueError(f"predictor history must be at least 1 (got {history})")
        self.values: deque[float] = deque(maxlen=history)
        self.last_fallback: str | None = None

    def add(self, value: float) -> None:
        # a NaN or inf would poison every later fit: an interval that measured nothing adds nothing
        if math.isfinite(value):
            self.values.append(max(0.0, float(value)))

    def predict(self) -> float:
        self.last_fallback = None
        if not self.values:
            self.last_fallback = "no history: 0"
            return 0.0
        last = self.values[-1]
        n = len(self.values)
        if n < self.min_points:
            self.last_fallback = f"{n} of {self.min_points} points: last value"
            return last
        y = np.fromiter(self.values, dtype=float, count=n)
        if np.ptp(y) == 0.0:
            return last
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = float(self._forecast(y))
        except Exception as e:  # a fit that fails must not stop the planner: it says so instead
            self.last_fallback = f"{self.kind} fit failed ({type(e).__name__}: {e}): last value"
            return last
        # a ResourceWarning is the garbage collector finalising some other object (an unclosed socket)
        # while the fit ran, not a word about the fit
        caught = [w for w in caught if not issubclass(w.category, ResourceWarning)]
        if caught:
            w = caught[0]
            self.last_fallback = f"{self.kind} fit warned ({w.category.__name__}: {w.message}): last value"
            return last
        if not math.isfinite(value):
            self.last_fallback = f"{self.kind} forecast {value}: last value"
            return last
        return max(0.0, value)

    @abc.abstractmethod
    def _forecast(self, y: np.ndarray) -> float:
        """The next value after ``y`` (at least ``min_points`` values, not all equal)."""


class ConstantPredictor(_Window):
    kind: PredictorKind = "constant"

    def _forecast(self, y: np.ndarray) -> float:
        return float(y[-1])


class LinearPredictor(_Window):
    kind: PredictorKind = "linear"
    min_points = 2

    def _forecast(self, y: np.ndarray) -> float:
        slope, intercept = np.polyfit(np.arange(len(y), dtype=float), y, 1)
        return float(slope * len(y) + intercept)


class _Standardized(_Window):
    """Fits on the window standardized to mean 0, sd 1: request rates in the thousands and hit
    rates below 1 then start the likelihood optimizer from the same scale."""

    min_points = 8  # three or more fitted parameters: fewer points than this fit noise

    def _forecast(self, y: np.ndarray) -> float:
        mean, sd = float(y.mean()), float(y.std())
        return self._fit_forecast((y - mean) / sd) * sd + mean

    @abc.abstractmethod
    def _fit_forecast(self, z: np.ndarray) -> float: ...


class KalmanPredictor(_Standardized):
    kind: PredictorKind = "kalman"

    def _fit_forecast(self, z: np.ndarray) -> float:
        # imported on first use: statsmodels takes seconds to import, constant/linear need none of it
        from statsmodels.tsa.statespace.structural import UnobservedComponents

        # Nelder-Mead: L-BFGS (the default) stopped short of convergence on one window in sixteen of a
        # clean rising line (its variances tend to 0, the bound) and took several times longer
        res: Any = UnobservedComponents(z, level="local linear trend").fit(disp=False, method="nm",
                                                                           maxiter=1000)
        return float(res.forecast(1)[0])


class ArimaPredictor(_Standardized):
    kind: PredictorKind = "arima"

    def _fit_forecast(self, z: np.ndarray) -> float:
        from statsmodels.tsa.arima.model import ARIMA

        # trend "t" with d=1 is a drift: a constant step per interval
        model = ARIMA(z, order=ARIMA_ORDER, trend="t")
        # our own start (drift = mean step, no MA, the steps' variance): statsmodels' own start
        # warned "non-invertible starting MA parameters" on a sixth of windows, a fallback each time
        steps = np.diff(z)
        start = {"x1": float(steps.mean()), "ma.L1": 0.0, "sigma2": max(float(steps.var()), 1e-3)}
        res: Any = model.fit(start_params=[start[name] for name in model.param_names])
        return float(res.forecast(1)[0])


_CLASSES: dict[str, type[_Window]] = {
    "constant": ConstantPredictor, "linear": LinearPredictor,
    "kalman": KalmanPredictor, "arima": ArimaPredictor,
}


def make_predictor(kind: PredictorKind, history: int) -> Predictor:
    """A predictor of ``kind`` that keeps the newest ``history`` values."""
    try:
        cls = _CLASSES[kind]
    except KeyError:
        raise ValueError(f"unknown predictor {kind!r} (known: {', '.join(KINDS)})") from None
    return cls(history)
