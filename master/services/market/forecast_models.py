"""Demand forecasting models: the seasonal baseline, and a small learned model used for a series only where it
beats the baseline on held-out days.

**The baseline** (``seasonal_forecast``): an hour's forecast is the mean of the same hour of day over the last
``seasons`` days of history.

**The model** (``fit``/``learned_forecast``): a ridge regression of an hour's demand on what was known a day before
it — the same hour one, two and seven days before, the seasonal baseline's value for it (the mean of the same hour
over the last seven days), the mean of the 24 hours that ended a day before it, and a constant. It learns what the
baseline cannot: a weekly rhythm (weekends differ: the same hour a week before), and a trend (demand that grows or
shrinks from day to day: the recent level against the week's mean). Hours further ahead than a day are forecast
recursively, the forecast standing in for the hours not seen yet.

**The choice** (``choose_forecast``): the last ``HELD_OUT_DAYS`` days of the history are held out one at a time —
each forecast by both methods from the history before it — and the learned model is used only where its mean
absolute error on them is below ``1 - MARGIN`` times the baseline's; otherwise, and on a history too short to learn
from (``MIN_HOURS``, counted from the series' first demand: the hours before a model and region were ever wanted
are no history of them, and a model fitted across that onset learns the onset), the baseline. The choice and both errors are part of the answer, so an operator sees why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DAY = 24
WEEK = 7 * DAY
HELD_OUT_DAYS = 2
MARGIN = 0.05  # the learned model must be 5 % better on the held-out days
RIDGE = 1.0  # L2 penalty on the weights (not on the constant)
MIN_EXAMPLES = 2 * DAY  # hours to fit on, at least
# The first hour the model has every feature for is one week in; then examples to fit on; then the held-out days.
MIN_HOURS = WEEK + MIN_EXAMPLES + HELD_OUT_DAYS * DAY
FEATURES = ("day_before", "two_days_before", "week_before", "seasonal_mean", "level", "constant")

BASELINE = "seasonal"
LEARNED = "learned"


def seasonal_forecast(history: Sequence[float], *, horizon: int = 24, period: int = 24, seasons: int = 7) -> list[float]:
    """The next ``horizon`` values: each the mean of the values one, two, … ``seasons`` periods before it (those
    that exist); 0 with no history at all."""
    forecast = []
    for ahead in range(horizon):
        position = len(history) + ahead
        same_hour = [history[position - k * period] for k in range(1, seasons + 1) if 0 <= position - k * period < len(history)]
        forecast.append(sum(same_hour) / len(same_hour) if same_hour else 0.0)
    return forecast


def mean_absolute_error(predicted: Sequence[float], actual: Sequence[float]) -> float:
    if len(predicted) != len(actual) or not actual:
        raise ValueError("predicted and actual must be as long as each other, and not empty")
    return sum(abs(p - a) for p, a in zip(predicted, actual, strict=True)) / len(actual)


@dataclass(frozen=True, slots=True)
class Model:
    weights: np.ndarray  # one per FEATURES


@dataclass(frozen=True, slots=True)
class Choice:
    method: str  # BASELINE or LEARNED
    forecast: list[float]
    baseline_error: float | None  # mean absolute error over the held-out days (None: too little history)
    learned_error: float | None


def _features(series: Sequence[float], t: int) -> list[float]:
    """The features of hour ``t`` of ``series``: values a day or more before it only (``t >= WEEK``)."""
    same_hour = [series[t - k * DAY] for k in range(1, 8)]
    level = sum(series[t - 2 * DAY + 1 : t - DAY + 1]) / DAY
    return [series[t - DAY], series[t - 2 * DAY], series[t - WEEK], sum(same_hour) / 7, level, 1.0]


def fit(history: Sequence[float], *, ridge: float = RIDGE) -> Model:
    """Ridge regression on every hour of ``history`` that has a week before it (``ValueError`` if too few)."""
    hours = range(WEEK, len(history))
    if len(hours) < MIN_EXAMPLES:
        raise ValueError(f"a learned forecast needs at least {WEEK + MIN_EXAMPLES} hours of history, not {len(history)}")
    x = np.array([_features(history, t) for t in hours])
    y = np.array([history[t] for t in hours])
    penalty = ridge * np.eye(len(FEATURES))
    penalty[-1, -1] = 0.0  # the constant is not shrunk
    weights = np.linalg.solve(x.T @ x + penalty, x.T @ y)
    return Model(weights)


def learned_forecast(history: Sequence[float], *, horizon: int = DAY, model: Model | None = None) -> list[float]:
    """The next ``horizon`` hours, from ``model`` (fitted on ``history`` when not given); never below 0."""
    model = model if model is not None else fit(history)
    series = list(history)
    for _ in range(horizon):
        series.append(max(0.0, float(np.dot(model.weights, _features(series, len(series))))))
    return series[len(history) :]


def held_out_errors(history: Sequence[float], *, days: int = HELD_OUT_DAYS) -> tuple[float, float]:
    """Mean absolute error of (baseline, learned) over the last ``days`` days, each forecast from the hours before it."""
    baseline, learned = [], []
    for day in range(days, 0, -1):
        cut = len(history) - day * DAY
        seen, actual = history[:cut], history[cut : cut + DAY]
        baseline.append(mean_absolute_error(seasonal_forecast(seen, horizon=DAY), actual))
        learned.append(mean_absolute_error(learned_forecast(seen, horizon=DAY), actual))
    return sum(baseline) / days, sum(learned) / days


def choose_forecast(history: Sequence[float], *, horizon: int = DAY) -> Choice:
    """The forecast of the method that did better on the held-out days (see the module docstring)."""
    first = next((hour for hour, value in enumerate(history) if value > 0), len(history))
    if len(history) - first < MIN_HOURS:
        return Choice(BASELINE, seasonal_forecast(history, horizon=horizon), None, None)
    baseline_error, learned_error = held_out_errors(history[first:])
    if learned_error < (1 - MARGIN) * baseline_error:
        return Choice(LEARNED, learned_forecast(history[first:], horizon=horizon), baseline_error, learned_error)
    return Choice(BASELINE, seasonal_forecast(history, horizon=horizon), baseline_error, learned_error)


__all__ = ["BASELINE", "FEATURES", "LEARNED", "MIN_HOURS", "Choice", "Model", "choose_forecast", "fit",
           "held_out_errors", "learned_forecast", "mean_absolute_error", "seasonal_forecast"]  # fmt: skip
