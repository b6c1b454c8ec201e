"""The GPU challenge's rules, the master's half, Sans-I/O: its size and deadline from the claimed GPU, what the host
is sent, which rows, chunks and columns the master opens once the host has committed, and the verdict per GPU
(docs/verification.md). The host's half (the arithmetic, the Merkle tree, the in-container program) is
``shared.verification``, which this builds on and which never imports this.

Imports stdlib, numpy, ``shared.verification.compute`` and ``master.services.market`` (the model table's sustained
rates, ``sustained_tflops``); no database, no network.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from master.services.market import sustained_tflops
from shared.verification import compute

VERSION: Final = 1
FILL: Final = 0.90
"""A, B and C fill at least this share of the claimed GPU's memory."""
SIZE_STEP: Final = 8
SLACK: Final = 1.5
"""The deadline allows the product this many times its expected time (cooling, power limits, board variants)."""
GENERATE_ELEMENTS_PER_S: Final = 5e9
"""Allowance for building A and B on the GPU (measured: 11 G elements/s with unfused torch ops on an H200)."""
HASH_BYTES_PER_S: Final = 1e9
"""Allowance for hashing C's rows: copied to the host and hashed there (measured: 1.0–1.4 GB/s on the H200's VM)."""
OVERHEAD_S: Final = 30.0
"""Allowance for what is not arithmetic: the command's way to the host and back, the container's start, CUDA's."""
ROWS: Final = 32
"""s: rows opened per GPU, one chunk of each (docs/verification.md: the openings' size and the detection)."""
GROUPS: Final = 8
"""g: the opened rows fall into this many groups (of s/g = 4 rows); a group's rows open the same chunk, distinct
chunks for distinct groups, so the columns the master checks in it are shared by its rows (its cost: the
distinct columns of B it builds, g·t of them, not s·t)."""
COLUMNS: Final = 8
"""t: entries recomputed in each opened chunk, the same columns for every row of the chunk's group."""
SIM_VRAM_DIVISOR: Final = 16384
"""A simulated host's claimed memory is divided by this (an 80 GB card: n ≈ 770), ..."""
SIM_TFLOPS_DIVISOR: Final = 1e6
"""... and its expected rate by this (an H100's 600 TFLOP/s: 0.6 GFLOP/s, ~1.5 s for n = 770 on the CPU's ~0.1 s)."""


class Reason(enum.StrEnum):
    """Why a GPU's challenge ended as it did; every one but ``PASSED`` is the provider's failure."""

    PASSED = "passed"
    WRONG_RESULT = "wrong_result"  # an opened entry is not A_i · B_:j
    BAD_PROOF = "bad_proof"  # an opened chunk is not the committed one (proofs, length, a row or chunk not asked or missing)
    TOO_SLOW = "too_slow"  # the commitment came after the deadline
    MEMORY_SHORT = "memory_short"  # the host could not hold the claimed size
    REPLAYED_COMMITMENT = "replayed_commitment"  # a commitment of another challenge
    NO_ANSWER = "no_answer"  # nothing came back: the host lost, a timeout
    WORKLOAD_FAILED = "workload_failed"  # the container did not run or could not see its GPU


@dataclass(frozen=True)
class Verdict:
    outcome: str  # "passed" | "failed"
    reason: Reason
    message: str
    tflops: float  # 2n³ / the time to commit, in the claimed model's units (0 when it failed)
    vram_mib: int  # what A, B and C took, in the claimed model's units (0 when it failed)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reason": str(self.reason)}


def _failed(reason: Reason, message: str) -> Verdict:
    return Verdict("failed", reason, message, 0.0, 0)


def size_for(vram_mib: float, dtype: str) -> int:
    """The smallest n, a multiple of 8, whose A and B in ``dtype`` and C in fp32 fill ≥ 90 % of ``vram_mib``."""
    per_element = 2 * compute.DTYPE_BYTES[dtype] + 4
    n = math.ceil(math.sqrt(FILL * vram_mib * 2**20 / per_element) / SIZE_STEP) * SIZE_STEP
    return min(max(n, SIZE_STEP), compute.MAX_N // SIZE_STEP * SIZE_STEP)


def expected_tflops(model_key: str, dtype: str) -> float | None:
    """The sustained rate a ``model_key`` GPU should reach in ``dtype`` (TFLOP/s; ``None`` for an unknown model or a
    precision it has no tensor path for): ``master.services.market.sustained_tflops``, the datasheet figure of the
    model table times the share measured on an H200."""
    return sustained_tflops(model_key, dtype)


def deadline_s(n: int, model_key: str, dtype: str, *, slack: float = SLACK, scale: float = 1.0,
               overhead_s: float = OVERHEAD_S, fallback_tflops: float = 10.0) -> float:  # fmt: skip
    """Seconds from the challenge's sending to its commitment's arrival: the product at the claimed model's
    expected rate (divided by ``scale``; ``fallback_tflops`` for an unknown model) times ``slack``, plus the
    allowances for building A and B, hashing C and ``overhead_s``."""
    tflops = (expected_tflops(model_key, dtype) or fallback_tflops) / scale
    product = 2 * n**3 / (tflops * 1e12)
    return product * slack + 2 * n * n / GENERATE_ELEMENTS_PER_S + 4 * n * n / HASH_BYTES_PER_S + overhead_s


def make_challenge(*, challenge_id: str, seed: bytes, gpus: Sequence[Mapping[str, Any]], dtype: str,
                   slack: float = SLACK, overhead_s: float = OVERHEAD_S, simulation: bool = False) -> dict[str, Any]:  # fmt: skip
    """What the agent is sent: per claimed GPU (``{"uuid", "model_key", "vram_mib"}``, the claim) its size and
    expected rate, and one deadline for all (they run at once). ``simulation`` scales the claim down for a CPU
    (``SIM_*_DIVISOR``); the verdicts report figures in the claimed model's units either way."""
    if dtype not in compute.DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(compute.DTYPE_BYTES)}")
    if not gpus:
        raise ValueError("a challenge needs at least one GPU")
    vram_scale, tflops_scale = (SIM_VRAM_DIVISOR, SIM_TFLOPS_DIVISOR) if simulation else (1, 1.0)
    entries = []
    for gpu in gpus:
        n = size_for(gpu["vram_mib"] / vram_scale, dtype)
        rate = expected_tflops(gpu["model_key"], dtype)
        entries.append({"uuid": gpu["uuid"], "model_key": gpu["model_key"], "n": n,
                        "expected_tflops": rate,  # in the claimed model's units
                        "deadline_s": deadline_s(n, gpu["model_key"], dtype, slack=slack, scale=tflops_scale,
                                                 overhead_s=overhead_s)})  # fmt: skip
    return {"version": VERSION, "challenge_id": challenge_id, "seed": seed.hex(), "dtype": dtype,
            "deadline_s": max(entry["deadline_s"] for entry in entries), "gpus": entries,
            "scale": {"vram": vram_scale, "tflops": tflops_scale}}  # fmt: skip


def choose_reveal(rng: random.Random, challenge: Mapping[str, Any], *, rows: int = ROWS, groups: int = GROUPS,
                  columns: int = COLUMNS) -> dict[str, Any]:  # fmt: skip
    """After the commitment: per GPU, ``rows`` distinct rows (``rows``, ascending), in each one chunk the host
    must open (``chunks``, aligned with ``rows``) and in each opened chunk ``columns`` distinct columns
    (``columns``: a list per row, global column indices) whose entries the master recomputes. The rows fall at
    random into ``groups`` groups; a group's rows open one chunk (distinct groups distinct chunks where the row
    has as many) and are checked at the same columns. ``rng`` must be unpredictable to the host
    (``random.SystemRandom()``; a seeded ``random.Random`` in tests)."""
    chosen = {}
    for gpu in challenge["gpus"]:
        n = gpu["n"]
        width, count = compute.chunk_width(n), compute.chunk_count(n)
        opened = rng.sample(range(n), min(rows, n))  # in random order: the k-th row joins group k mod g
        shared = max(1, min(groups, len(opened)))
        group_chunks = rng.sample(range(count), shared) if count >= shared else [rng.randrange(count) for _ in range(shared)]
        group_cells = []
        for k in group_chunks:
            inside = range(k * width, min(n, (k + 1) * width))
            group_cells.append(sorted(rng.sample(inside, min(columns, len(inside)))))
        asked = sorted((row, m % shared) for m, row in enumerate(opened))
        chosen[gpu["uuid"]] = {"rows": [row for row, _ in asked], "chunks": [group_chunks[g] for _, g in asked],
                               "columns": [list(group_cells[g]) for _, g in asked]}  # fmt: skip
    return {"challenge_id": challenge["challenge_id"], "gpus": chosen}


def checked_entries(seed: bytes, n: int, rows: Sequence[int], columns: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """``A[rows[k], :] · B[:, columns[k]]`` for each k (int64), from a GPU's seed: the rows of A and each distinct
    column of B built once (``compute.element_rows``/``element_cols``), so rows checked at the same columns (a
    reveal's group) share the columns' cost. Exact: fp32 sums of n ternary products (|·| ≤ n < 2²⁴)."""
    distinct = sorted({int(j) for cells in columns for j in cells})
    where = {j: k for k, j in enumerate(distinct)}
    a = compute.element_rows(seed, "A", rows, n)
    b = compute.element_cols(seed, "B", distinct, n).T  # one contiguous row per distinct column
    by_columns: dict[tuple[int, ...], list[int]] = {}
    for k, cells in enumerate(columns):
        by_columns.setdefault(tuple(int(j) for j in cells), []).append(k)
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(rows)
    for cells, members in by_columns.items():
        block = a[members].astype(np.float32) @ b[[where[j] for j in cells]].astype(np.float32).T
        for m, k in enumerate(members):
            out[k] = block[m].astype(np.int64)
    return out


def verify(challenge: Mapping[str, Any], commitment: Mapping[str, Any], reveal: Mapping[str, Any],
           openings: Mapping[str, Any], *, committed_after_s: float, seen_roots: Collection[str] = ()) -> dict[str, Verdict]:  # fmt: skip
    """The verdict for each challenged GPU. ``committed_after_s``: the master's own clock from sending the
    challenge to receiving the commitment; ``seen_roots``: roots committed to earlier challenges (any of them
    again is a replay). ``openings`` may be empty when the commitment failed or came late."""
    verdicts = {}
    replayed = commitment.get("challenge_id") != challenge["challenge_id"]
    committed = commitment.get("gpus") or {}
    opened = openings.get("gpus") or {}  # openings of another challenge fail their proofs: the leaves bind the id
    seed = bytes.fromhex(challenge["seed"])
    for gpu in challenge["gpus"]:
        uuid = gpu["uuid"]
        entry = committed.get(uuid)
        if replayed:
            verdicts[uuid] = _failed(Reason.REPLAYED_COMMITMENT, f"the commitment answers challenge {commitment.get('challenge_id')!r}, not {challenge['challenge_id']!r}")
        elif not isinstance(entry, Mapping):
            verdicts[uuid] = _failed(Reason.NO_ANSWER, f"the commitment has nothing for GPU {uuid}")
        elif entry.get("reason") is not None:
            reason = Reason(entry["reason"]) if entry["reason"] in (Reason.MEMORY_SHORT, Reason.WORKLOAD_FAILED) else Reason.WORKLOAD_FAILED
            verdicts[uuid] = _failed(reason, str(entry.get("message") or entry["reason"])[:500])
        elif not isinstance(entry.get("root"), str):
            verdicts[uuid] = _failed(Reason.BAD_PROOF, f"the commitment's root for GPU {uuid} is not a hex string")
        elif entry["root"] in seen_roots:
            verdicts[uuid] = _failed(Reason.REPLAYED_COMMITMENT, f"GPU {uuid}'s root was committed to an earlier challenge")
        elif committed_after_s > challenge["deadline_s"]:
            verdicts[uuid] = _failed(Reason.TOO_SLOW, f"committed after {committed_after_s:.1f} s; the deadline was {challenge['deadline_s']:.1f} s")
        else:
            verdicts[uuid] = _check(challenge, gpu, compute.gpu_seed(seed, uuid), entry, reveal["gpus"][uuid], opened.get(uuid),
                                    committed_after_s=committed_after_s)  # fmt: skip
    return verdicts


def _check(challenge: Mapping[str, Any], gpu: Mapping[str, Any], seed: bytes, entry: Mapping[str, Any],
           asked: Mapping[str, Any], items: Any, *, committed_after_s: float) -> Verdict:  # fmt: skip
    uuid, n = gpu["uuid"], gpu["n"]
    if items is None:
        return _failed(Reason.NO_ANSWER, f"no openings came back for GPU {uuid}")
    width, count = compute.chunk_width(n), compute.chunk_count(n)
    try:
        root = bytes.fromhex(entry["root"])
        by_row = {int(item["row"]): item for item in items}
        if sorted(by_row) != sorted(asked["rows"]) or len(items) != len(by_row):
            return _failed(Reason.BAD_PROOF, f"GPU {uuid} opened rows {sorted(by_row)[:8]}…, not the {len(asked['rows'])} asked")
        ctx = compute.context(challenge["challenge_id"], uuid)
        values = []
        for index, chunk in zip(asked["rows"], asked["chunks"], strict=True):
            item = by_row[index]
            if int(item["chunk"]) != chunk:
                return _failed(Reason.BAD_PROOF, f"GPU {uuid} opened chunk {item['chunk']} of row {index}, not chunk {chunk}")
            start = chunk * width
            opened = compute.decode_values(item["values"], min(n, start + width) - start)
            leaf = compute.leaf_hash(ctx, index, chunk, opened)
            row = compute.proof_root(leaf, chunk, count, compute.decode_proof(item["chunk_proof"]))
            if row is None or not compute.verify_proof(root, row, index, n, compute.decode_proof(item["row_proof"])):
                return _failed(Reason.BAD_PROOF, f"GPU {uuid}'s row {index}, chunk {chunk} does not match its committed root")
            values.append((start, np.frombuffer(opened, dtype="<i4")))
    except (KeyError, TypeError, ValueError) as exc:
        return _failed(Reason.BAD_PROOF, f"GPU {uuid}'s openings are malformed: {exc}")
    checked = 0
    expected_rows = checked_entries(seed, n, asked["rows"], asked["columns"])
    for k, (index, (start, chunk_values)) in enumerate(zip(asked["rows"], values, strict=True)):
        columns = np.asarray(asked["columns"][k], dtype=np.int64)
        expected = expected_rows[k]
        got = chunk_values[columns - start].astype(np.int64)
        wrong = np.flatnonzero(expected != got)
        if len(wrong):
            j = wrong[0]
            return _failed(Reason.WRONG_RESULT, f"GPU {uuid}: C[{index}, {columns[j]}] is {got[j]}, not {expected[j]} "
                                                f"({len(wrong)} of the row's {got.size} checked entries wrong)")  # fmt: skip
        checked += got.size
    tflops = 2 * n**3 / max(committed_after_s, 1e-9) / 1e12 * challenge["scale"]["tflops"]
    vram_mib = round(compute.bytes_needed(n, challenge["dtype"]) / 2**20 * challenge["scale"]["vram"])
    return Verdict("passed", Reason.PASSED, f"{len(asked['rows'])} chunks and {checked} entries checked", tflops, vram_mib)
