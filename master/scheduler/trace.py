"""Reading the Alibaba GPU cluster trace v2023 (the FGD paper's "openb" trace) into the scheduler's model.

Two CSV shapes, as the trace ships them:

* nodes — ``sn,cpu_milli,memory_mib,gpu,model`` (``model`` empty or ``nan`` on CPU-only nodes);
* pods — ``name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,...]``;
  ``gpu_spec`` is ``"A|B"`` (any of those models) or empty; columns past the ones read
  are ignored, so every ``openb_pod_list_*.csv`` loads.

Every pod of the file is a task to place, whatever its recorded phase (the FGD
simulator replays them all). A bad file fails with ``TraceError`` naming the file,
the line and the column, never with a bare ``KeyError`` or ``ValueError`` from deep inside.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from master.scheduler.fleet import MILLI, Node, Request
from shared.errors import GpumarketError

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
_MISSING = {"", "nan", "none", "null"}


class TraceError(GpumarketError, ValueError):
    """A trace file is missing, unreadable or malformed; the message says where."""

    code = "trace_invalid"


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str

    def to_node(self) -> Node:
        """A fresh, empty ``Node`` (trace GPUs carry no memory figure: memory is not tracked)."""
        return Node(self.name, self.model, self.gpus, cpu_milli=self.cpu_milli, memory_mib=self.memory_mib)


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    request: Request


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            header = [name.strip() for name in reader.fieldnames or []]
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(f"{path}: not a CSV file ({exc})") from None
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceError(
                f"{path}: line 1 must be a header with the columns {', '.join(required)}; "
                f"missing {', '.join(missing)} (found: {', '.join(header) or 'nothing'})"
            )
        reader.fieldnames = header
        try:
            for row in reader:
                if None in row:  # more cells than the header has names
                    raise TraceError(f"{path}:{reader.line_num}: more cells than the header's {len(header)} columns")
                if all(not (value or "").strip() for value in row.values()):
                    continue  # a blank line
                yield reader.line_num, row
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


def _int(path: Path, line: int, row: dict[str, str], column: str, *, default: int | None = None) -> int:
    raw = (row.get(column) or "").strip()
    if raw.lower() in _MISSING:
        if default is not None:
            return default
        raise TraceError(f"{path}:{line}: column {column!r} is empty")
    try:
        number = float(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column!r} is {raw!r}, not a number") from None
    if not math.isfinite(number) or number != int(number) or number < 0:
        raise TraceError(f"{path}:{line}: column {column!r} is {raw!r}, not a whole number ≥ 0")
    return int(number)


def _text(row: dict[str, str], column: str) -> str:
    raw = (row.get(column) or "").strip()
    return "" if raw.lower() in _MISSING else raw


def load_nodes(path: str | Path) -> list[TraceNode]:
    """The nodes of a trace node list (``openb_node_list_*.csv``)."""
    path = Path(path)
    nodes: list[TraceNode] = []
    seen: set[str] = set()
    for line, row in _rows(path, NODE_COLUMNS):
        name = _text(row, "sn")
        if not name:
            raise TraceError(f"{path}:{line}: column 'sn' (the node name) is empty")
        if name in seen:
            raise TraceError(f"{path}:{line}: node {name!r} appears twice")
        seen.add(name)
        gpus = _int(path, line, row, "gpu", default=0)
        model = _text(row, "model")
        if gpus and not model:
            raise TraceError(f"{path}:{line}: node {name!r} has {gpus} GPUs but no model")
        nodes.append(TraceNode(name, _int(path, line, row, "cpu_milli"), _int(path, line, row, "memory_mib"), gpus, model))
    if not nodes:
        raise TraceError(f"{path}: no nodes in it")
    return nodes


def load_pods(path: str | Path) -> list[TracePod]:
    """The pods of a trace pod list (``openb_pod_list_*.csv``), as placement requests."""
    path = Path(path)
    pods: list[TracePod] = []
    for line, row in _rows(path, POD_COLUMNS):
        num_gpu = _int(path, line, row, "num_gpu", default=0)
        gpu_milli = _int(path, line, row, "gpu_milli", default=0)
        if num_gpu and not 0 < gpu_milli <= MILLI:
            raise TraceError(f"{path}:{line}: gpu_milli must be 1..{MILLI} for a pod with GPUs, not {gpu_milli}")
        if num_gpu > 1 and gpu_milli != MILLI:
            raise TraceError(f"{path}:{line}: a pod with {num_gpu} GPUs must take them whole (gpu_milli {MILLI})")
        request = Request(
            num_gpu=num_gpu,
            gpu_milli=gpu_milli if num_gpu else 0,
            gpu_models=Request.parse_models(_text(row, "gpu_spec")),
            cpu_milli=_int(path, line, row, "cpu_milli"),
            memory_mib=_int(path, line, row, "memory_mib", default=0),
        )
        pods.append(TracePod(_text(row, "name") or f"line-{line}", request))
    if not pods:
        raise TraceError(f"{path}: no pods in it")
    return pods


NODE_LIST = "openb_node_list_gpu_node.csv"


@functools.cache
def load_variant(trace_dir: str | Path, variant: str) -> tuple[list[TraceNode], list[Request]]:
    """A trace variant as the simulator takes it: the directory's node list and the pods of ``openb_pod_list_<variant>.csv``
    as requests, read once per process (the benches run many seeds and placers over one variant). The lists are
    shared: callers must not change them."""
    trace_dir = Path(trace_dir)
    return load_nodes(trace_dir / NODE_LIST), [pod.request for pod in load_pods(trace_dir / f"openb_pod_list_{variant}.csv")]
