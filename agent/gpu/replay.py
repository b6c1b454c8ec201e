"""GPUs replayed from an NVML recording: what a real host's NVML answered, without the host.

A recording holds the answers NVML gave the agent's own collection code
(``agent.gpu.nvml``) on a real host: ``agent.record.record_nvml`` runs that code
through a stand-in that passes every call to NVML and writes the answer down.
``ReplayNvml`` is the opposite stand-in: it answers the same calls from the recording,
raising ``pynvml``'s own exception classes where NVML failed, so that
``ReplayBackend`` is simply ``NvmlBackend`` driven by it: the same ``_maybe``, the
same fallbacks, the same decoding as on hardware. Imports ``agent.gpu`` and
``shared`` only.

The format, version 1, is one JSON document::

    {"format": "gpumarket-nvml-recording", "version": 1,
     "source": {"gpus": [...], "driver_version": ..., "cuda_driver_version": ...,
                "recorded_at": ..., "how": ..., ...},
     "calls": {"open":  {SCOPE: {FUNCTION: {ARGS: ANSWER}}},
               "ticks": [{"at": "...", "calls": {SCOPE: {FUNCTION: {ARGS: ANSWER}}}}, ...]}}

* ``open`` holds the calls made while the backend opened (identity, handles, the
  event set); each ``ticks`` entry the calls of one sampling pass and the event poll
  after it, in recording order.
* SCOPE says what a call was about: ``"system"`` (no device handle), ``"gpu0"`` (the
  handle ``nvmlDeviceGetHandleByIndex(0)`` gave), ``"gpu0/mig1"`` (the MIG device in
  slot 1 of GPU 0).
* ARGS are the call's arguments after the handle, comma-separated: ``""`` for none,
  ``"0"`` for ``NVML_CLOCK_SM``-style integers, ``"event_set"`` for the event set.
* ANSWER is ``{"value": V}`` or ``{"error": "NVMLError_NotSupported", "code": 3}``;
  a list of answers where one phase made the same call several times (the event
  poll: events, then ``NVMLError_Timeout``): the n-th call gets the n-th answer, and
  the last one repeats. A value the recorder withheld (serial numbers) reads
  ``{"value": "REDACTED", "redacted": true}``.
* V is JSON: NVML structures become objects of their fields (replayed as attribute
  objects), device handles ``{"$handle": SCOPE}``, the event set
  ``{"$opaque": "event_set"}``; bytes are decoded to text.

During tick k a call is looked up in that tick, then in ``open``. A call found in
neither is answered ``NVMLError_FunctionNotFound``: to ``_maybe`` that is "not
available" (``None``), exactly like ``NotSupported``, and it lets a fallback chain
(``nvmlDeviceGetTemperatureV`` → ``nvmlDeviceGetTemperature``) go on to the older
function, as a driver without the newer one would. ``nvmlInit``, ``nvmlShutdown`` and
``nvmlEventSetFree`` always succeed. Constants come from ``pynvml``.

Power limits: a recording holds no answer for ``nvmlDeviceSetPowerManagementLimit``, so the
replay models it: the set is recorded (``power_limit_sets``), the limit reads answer the value
set, recorded draws above it are capped at it, and a capped pass's clocks-event reasons gain
``sw_power_cap``. A recorded draw below the limit is replayed as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from agent.gpu.base import GpuEvent, GpuInfo, GpuSample
from agent.gpu.nvmlbackend import NvmlBackend
from shared.clock import utcnow
from shared.errors import ConfigError, GpuBackendUnavailable

REPLAY_PREFIX = "replay:"
RECORDING_FORMAT = "gpumarket-nvml-recording"
RECORDING_VERSION = 1
REDACTED = "REDACTED"
SYSTEM_SCOPE = "system"
EVENT_SET = "event_set"
# Calls that start or stop NVML, or free what it allocated: not recorded, always succeed on replay.
LIFECYCLE_CALLS = frozenset(
    {"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlEventSetFree"}
)
# Larger than any sensible recording (an hour at one sample a second is ~50 MB); bounds a bad file.
MAX_RECORDING_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReplayHandle:
    """A device handle handed out by ``ReplayNvml``: the recording's SCOPE of that device."""

    scope: str


@dataclass(frozen=True, slots=True)
class ReplayOpaque:
    """Something NVML allocates and the caller only passes back (the event set)."""

    name: str


def takes_handle(function: str) -> bool:
    """Whether ``function``'s first argument is a device handle (the call's SCOPE)."""
    return function.startswith("nvmlDevice") and not function.startswith(
        ("nvmlDeviceGetCount", "nvmlDeviceGetHandleBy")
    )


def args_key(args: Sequence[Any], *, opaque_name: Callable[[Any], str | None]) -> str:
    """The ARGS of a call: integers as written, the event set by name, comma-separated."""
    parts: list[str] = []
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool):
            parts.append(str(arg))
            continue
        name = opaque_name(arg)
        if name is None:
            raise TypeError(f"an NVML argument of type {type(arg).__name__} has no place in a recording")
        parts.append(name)
    return ",".join(parts)


# One replayed answer: the value, or what makes the exception to raise instead (a fresh one
# each time: re-raising one instance would grow its traceback on every pass of a loop).
_Answer = tuple[Any, Callable[[], BaseException] | None]
_CallKey = tuple[str, str, str]  # (scope, function, args)


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(item) for item in value]
    if isinstance(value, dict):
        if "$handle" in value:
            return ReplayHandle(str(value["$handle"]))
        if "$opaque" in value:
            return ReplayOpaque(str(value["$opaque"]))
        return SimpleNamespace(**{str(key): _decode_value(item) for key, item in value.items()})
    return value


def _error_factory(answer: Mapping[str, Any], where: str) -> Callable[[], BaseException]:
    name = answer["error"]
    cls = getattr(pynvml, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, pynvml.NVMLError) and cls is not pynvml.NVMLError:
        return cls
    code = answer.get("code")
    if isinstance(code, int):
        # An error class this pynvml does not know: NVMLError maps the code as far as it can.
        return lambda: pynvml.NVMLError(code)
    raise ConfigError(
        f"NVML recording: {where} answers {name!r}, which is not a pynvml NVMLError class; "
        'write it as e.g. "NVMLError_NotSupported"',
        details={"at": where},
    )


def _decode_answer(answer: Any, where: str) -> _Answer:
    if not isinstance(answer, dict) or ("value" in answer) == ("error" in answer):
        raise ConfigError(
            f'NVML recording: {where} must be {{"value": ...}} or {{"error": "NVMLError_..."}}',
            details={"at": where},
        )
    if "error" in answer:
        return None, _error_factory(answer, where)
    return _decode_value(answer["value"]), None


def _decode_calls(calls: Any, where: str) -> dict[_CallKey, list[_Answer]]:
    if not isinstance(calls, dict):
        raise ConfigError(f"NVML recording: {where} must be an object of scopes", details={"at": where})
    decoded: dict[_CallKey, list[_Answer]] = {}
    for scope, functions in calls.items():
        if not isinstance(functions, dict):
            raise ConfigError(f"NVML recording: {where}.{scope} must be an object of functions")
        for function, by_args in functions.items():
            if not isinstance(by_args, dict):
                raise ConfigError(
                    f"NVML recording: {where}.{scope}.{function} must be an object of arguments"
                )
            for key, answers in by_args.items():
                here = f"{where}.{scope}.{function}({key})"
                sequence = answers if isinstance(answers, list) and answers else [answers]
                decoded[(scope, function, key)] = [_decode_answer(answer, here) for answer in sequence]
    return decoded


def validate_recording(recording: Any) -> dict[str, Any]:
    """``recording`` if it is a version-1 NVML recording; ``ConfigError`` saying what is wrong otherwise."""
    if not isinstance(recording, dict) or recording.get("format") != RECORDING_FORMAT:
        raise ConfigError(
            f'not an NVML recording: expected a JSON object with "format": "{RECORDING_FORMAT}" '
            "(make one on a GPU host with `gpumarket agent record-nvml --out FILE`)"
        )
    if recording.get("version") != RECORDING_VERSION:
        raise ConfigError(
            f"NVML recording version {recording.get('version')!r} is not supported; this agent reads "
            f"version {RECORDING_VERSION}: record it again with this agent"
        )
    calls = recording.get("calls")
    if not isinstance(calls, dict) or not isinstance(calls.get("open"), dict):
        raise ConfigError('NVML recording: "calls" must hold an "open" object and a "ticks" list')
    ticks = calls.get("ticks")
    if not isinstance(ticks, list) or not ticks or not all(isinstance(t, dict) for t in ticks):
        raise ConfigError('NVML recording: "calls.ticks" must be a non-empty list of sampling passes')
    return recording


def load_recording(path: Path, *, max_bytes: int = MAX_RECORDING_BYTES) -> dict[str, Any]:
    """Read and check the NVML recording at ``path``; ``ConfigError`` if it cannot be used."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"NVML recording {path} is {size:,} bytes, more than the {max_bytes:,} allowed")
        recording = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(
            f"cannot read the NVML recording {path}: {err}", details={"path": str(path)}
        ) from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"NVML recording {path} is not JSON: {err}", details={"path": str(path)}) from err
    return validate_recording(recording)


def _succeed(*_args: Any) -> None:
    return None


class ReplayNvml:
    """A stand-in for ``pynvml`` that answers the collection code's calls from a recording.

    ``start_tick(k)`` moves to the k-th sampling pass; before the first, calls are
    answered from the ``open`` phase. Attribute access mirrors ``pynvml``: an NVML
    function (one ``pynvml`` has or the recording holds) replays, anything else is
    ``pynvml``'s own attribute.
    """

    def __init__(self, recording: Mapping[str, Any]) -> None:
        calls = validate_recording(recording)["calls"]
        self._open = _decode_calls(calls["open"], "calls.open")
        self._ticks = [
            _decode_calls(tick.get("calls", {}), f"calls.ticks[{index}].calls")
            for index, tick in enumerate(calls["ticks"])
        ]
        self._functions = {function for _, function, _ in self._open}
        for tick in self._ticks:
            self._functions.update(function for _, function, _ in tick)
        self._tick: dict[_CallKey, list[_Answer]] | None = None
        self._positions: dict[_CallKey, int] = {}
        # Power limits set during the replay (milliwatts per SCOPE), and every set in order: the recording
        # holds no answer for a set, so the replay models it (see ``_replay``).
        self.power_limits_mw: dict[str, int] = {}
        self.power_limit_sets: list[tuple[str, int]] = []

    @property
    def tick_count(self) -> int:
        return len(self._ticks)

    def start_tick(self, index: int) -> None:
        """Answer from the ``index``-th sampling pass from now on, its call sequences from the start."""
        self._tick = self._ticks[index]
        self._positions.clear()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in LIFECYCLE_CALLS:
            return _succeed
        if name.startswith("nvml") and (callable(getattr(pynvml, name, None)) or name in self._functions):

            def replay(*args: Any) -> Any:
                return self._replay(name, args)

            replay.__name__ = name
            setattr(self, name, replay)  # found directly from now on, past __getattr__
            return replay
        return getattr(pynvml, name)

    def _replay(self, function: str, args: tuple[Any, ...]) -> Any:
        scope = SYSTEM_SCOPE
        if takes_handle(function):
            if not args or not isinstance(args[0], ReplayHandle):
                raise TypeError(f"{function} needs a device handle handed out by this replay")
            scope, args = args[0].scope, args[1:]
        if function == SET_POWER_LIMIT:
            (milliwatts,) = args
            self.power_limits_mw[scope] = int(milliwatts)
            self.power_limit_sets.append((scope, int(milliwatts)))
            return None
        limit = self.power_limits_mw.get(scope)
        if limit is not None and function in _LIMIT_READS:
            return limit
        value = self._recorded(scope, function, args)
        if limit is None or function not in _LIMITED_CALLS:
            return value
        if function == "nvmlDeviceGetPowerUsage":
            return min(int(value), limit)
        try:
            recorded_draw = self._recorded(scope, "nvmlDeviceGetPowerUsage", ())
        except pynvml.NVMLError:
            return value
        # A recorded draw above the limit set is held at it: the GPU says its power cap holds its clocks back.
        return int(value) | _SW_POWER_CAP if recorded_draw is not None and int(recorded_draw) > limit else value

    def _recorded(self, scope: str, function: str, args: tuple[Any, ...]) -> Any:
        """The recorded answer (or raised error) to ``function(args)`` on ``scope`` in the current pass."""
        key = (scope, function, args_key(args, opaque_name=_opaque_name))
        answers = None if self._tick is None else self._tick.get(key)
        if answers is None:
            answers = self._open.get(key)
        if answers is None:
            raise pynvml.NVMLError_FunctionNotFound()
        if len(answers) == 1:
            value, error = answers[0]
        else:
            position = self._positions.get(key, 0)
            self._positions[key] = position + 1
            value, error = answers[min(position, len(answers) - 1)]
        if error is not None:
            raise error()
        return value


SET_POWER_LIMIT = "nvmlDeviceSetPowerManagementLimit"
_LIMIT_READS = frozenset({"nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"})
_LIMITED_CALLS = _LIMIT_READS | {
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
}
_SW_POWER_CAP = 0x0004  # nvmlClocksEventReasonSwPowerCap


def _opaque_name(arg: Any) -> str | None:
    return arg.name if isinstance(arg, ReplayOpaque) else None


class ReplayBackend:
    """GPUs as an NVML recording shows them, read through ``NvmlBackend``'s own code.

    Each ``sample()`` plays the recording's next sampling pass, starting over after the
    last one when ``loop`` is true (otherwise ``GpuBackendUnavailable`` says the
    recording is spent); ``poll_events()`` reports the events recorded in the pass
    played last. Raises ``ConfigError`` for a file that is not a usable recording.
    """

    name: str = "replay"

    def __init__(
        self, path: Path | str, *, loop: bool = True, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.path: Path | None = Path(path)
        self._start(load_recording(self.path), loop=loop, clock=clock)

    @classmethod
    def from_recording(
        cls, recording: Mapping[str, Any], *, loop: bool = True, clock: Callable[[], datetime] = utcnow
    ) -> ReplayBackend:
        """A backend replaying a recording already in memory."""
        backend = cls.__new__(cls)
        backend.path = None
        backend._start(validate_recording(dict(recording)), loop=loop, clock=clock)
        return backend

    def _start(self, recording: dict[str, Any], *, loop: bool, clock: Callable[[], datetime]) -> None:
        self.recording = recording
        self._loop = loop
        self._nvml = ReplayNvml(recording)
        self._next_tick = 0
        self._inner = NvmlBackend(nvml=self._nvml, clock=clock)

    @property
    def source(self) -> dict[str, Any]:
        """Where the recording came from, as its ``source`` says."""
        source = self.recording.get("source")
        return dict(source) if isinstance(source, dict) else {}

    @property
    def tick_count(self) -> int:
        return self._nvml.tick_count

    def gpus(self) -> list[GpuInfo]:
        return self._inner.gpus()

    def sample(self) -> list[GpuSample]:
        if self._next_tick >= self._nvml.tick_count:
            if not self._loop:
                raise GpuBackendUnavailable(
                    f"the NVML recording {self.path or '(in memory)'} has no more samples: all "
                    f"{self._nvml.tick_count} were played; replay it with loop=True to start over"
                )
            self._next_tick = 0
        self._nvml.start_tick(self._next_tick)
        self._next_tick += 1
        return self._inner.sample()

    def set_power_limit(self, index: int, watts: float) -> float:
        """As on the recorded host (checked against its recorded range); the replay then serves the limit set
        and caps recorded draws at it. Every set is in ``power_limit_sets``."""
        return self._inner.set_power_limit(index, watts)

    def restore_power_limit(self, index: int) -> float:
        return self._inner.restore_power_limit(index)

    @property
    def power_limit_sets(self) -> list[tuple[str, int]]:
        """Every limit set during the replay, in order: (SCOPE, milliwatts)."""
        return list(self._nvml.power_limit_sets)

    def poll_events(self) -> list[GpuEvent]:
        """The events recorded in the sampling pass played last, once each."""
        return self._inner.poll_events()

    def close(self) -> None:
        self._inner.close()


def iter_calls(recording: Mapping[str, Any]) -> Iterator[tuple[str, str, str, str, Any]]:
    """Every recorded answer as ``(phase, scope, function, args, answer)``; phase is "open" or "tick<k>"."""
    calls = recording["calls"]
    phases = [("open", calls["open"])] + [
        (f"tick{index}", tick.get("calls", {})) for index, tick in enumerate(calls["ticks"])
    ]
    for phase, scopes in phases:
        for scope, functions in scopes.items():
            for function, by_args in functions.items():
                for key, answer in by_args.items():
                    yield phase, scope, function, key, answer
