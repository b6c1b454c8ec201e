"""The challenge's arithmetic: the seeded matrices, the product, the Merkle commitment over C's rows and its proofs.

Pure: stdlib and numpy (torch only inside the ``backend="torch"`` paths, imported there), and no import of the rest
of gpumarket, because the challenge image copies this file beside ``program.py`` and runs it with Debian's python3.

* **Generator.** Element (i, j) of A (tag ``"A"``) or B (tag ``"B"``) of an n×n matrix is
  ``splitmix64(key + (i·n + j + 1)·γ)``'s top 31 bits scaled to 0..2 (``(z >> 33)·3 >> 31``), minus 1: a
  ternary value in {-1, 0, 1}, where
  ``key`` is the first 8 bytes (little-endian) of SHA-256 over the seed and the tag. Any row of A or column of B
  is built alone in O(n) (``element_rows``, ``element_cols``), on the CPU (numpy, uint64) or a GPU (torch, int64
  with the shifts masked to be logical): the same numbers.
* **Exact product.** With ternary inputs every partial sum of C = A·B is an integer of magnitude ≤ n < 2²⁴, so
  fp32 (and any tensor-core accumulation in fp32) computes C exactly, in any order, in every precision the tier is
  sold in (-1, 0, 1 are exact in fp8, fp16, bf16, tf32). Rows are committed as little-endian int32.
* **Commitment** (two levels). Each row of C is cut into chunks of K = ``chunk_width(n)`` columns (the last one
  shorter). Chunk leaf (i, k) = SHA-256(0x00 ‖ ctx ‖ i as 8 bytes LE ‖ k as 8 bytes LE ‖ the chunk as int32 LE),
  where ctx = SHA-256(challenge id ‖ 0x00 ‖ GPU uuid): a root binds the challenge and the GPU, so it never
  verifies for another. Row i's hash is the Merkle root over its chunk leaves; the GPU's root is the Merkle root
  over the n row hashes. Node = SHA-256(0x01 ‖ left ‖ right); a level's odd last node is promoted unchanged.
  Opening one chunk costs K values and two proofs (⌈log₂ ⌈n/K⌉⌉ + ⌈log₂ n⌉ siblings), never a whole row.
* **Seeds per GPU.** ``gpu_seed(seed, uuid)``: each claimed GPU multiplies its own matrices, so one GPU's product
  never answers for another's.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

GAMMA: Final = 0x9E3779B97F4A7C15
MIX1: Final = 0xBF58476D1CE4E5B9
MIX2: Final = 0x94D049BB133111EB
DOMAIN: Final = b"gpumarket-verify/1\x00"
DTYPE_BYTES: Final = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes per element of A and B in each precision the challenge runs in (C is always 4 bytes: fp32)."""
MAX_N: Final = (1 << 23) - 1  # |C_ij| ≤ n must stay exact in fp32 (< 2²⁴) and fit an opening's int24 (< 2²³)
CHUNK: Final = 512
"""Columns per chunk of a row (the leaf of the commitment): 2 KiB of int32, so hashing a leaf releases the GIL
(CPython hashes ≥ 2048 bytes without it) and costs little more than hashing whole rows (docs/verification.md)."""


class MemoryShort(MemoryError):
    """The device cannot hold A, B and C at the challenge's size."""


def bytes_needed(n: int, dtype: str) -> int:
    """Memory A and B (in ``dtype``) and C (fp32) take at size n."""
    return n * n * (2 * DTYPE_BYTES[dtype] + 4)


def matrix_key(seed: bytes, tag: str) -> int:
    return int.from_bytes(hashlib.sha256(DOMAIN + seed + b"\x00" + tag.encode()).digest()[:8], "little")


def gpu_seed(seed: bytes, uuid: str) -> bytes:
    """The seed of one GPU's matrices, derived from the challenge's seed and the GPU's uuid."""
    return hashlib.sha256(DOMAIN + seed + b"\x00" + uuid.encode()).digest()


# ---- the generator (numpy) -----------------------------------------------------------------------


GENERATOR_BLOCK: Final = 1 << 15
"""Elements the numpy generator works on at a time: its two uint64 temporaries (256 KiB each) stay in the CPU's
cache, where whole-array passes over millions of elements would go to memory at every one of their ~12 steps."""
_AT_LEAST_1: Final = 715827883 << 33
_AT_LEAST_2: Final = 1431655766 << 33
"""``(z >> 33)·3 >> 31`` is ≥ 1 exactly when z ≥ ⌈2³¹/3⌉·2³³ and ≥ 2 when z ≥ ⌈2³²/3⌉·2³³, so the element
(that minus 1) is [z ≥ ⌈2³²/3⌉·2³³] − [z < ⌈2³¹/3⌉·2³³]: two comparisons instead of three uint64 passes."""


def _mix(z: np.ndarray, scratch: np.ndarray, out: np.ndarray) -> None:
    """``out`` (int8) = the ternary values of the pre-mixed words ``z`` (uint64, consumed; ``scratch`` the same
    shape). splitmix64's last step (``z ^= z >> 31``) changes only bits 0..32, which ``>> 33`` drops: skipped."""
    u64 = np.uint64
    np.right_shift(z, u64(30), out=scratch)
    z ^= scratch
    z *= u64(MIX1)
    np.right_shift(z, u64(27), out=scratch)
    z ^= scratch
    z *= u64(MIX2)
    np.subtract(np.greater_equal(z, u64(_AT_LEAST_2)).view(np.int8), np.less(z, u64(_AT_LEAST_1)).view(np.int8), out=out)


def _elements(key: int, outer: np.ndarray, inner: np.ndarray, block: int) -> np.ndarray:
    """The int8 matrix whose (p, q) is the element at flat index ``outer[p] + inner[q]`` (uint64 arrays), built
    ``block`` elements at a time: ``(outer + inner + 1)·γ + key`` is ``outer·γ`` plus
    ``(inner + 1)·γ + key`` (mod 2⁶⁴), so each block starts from one addition."""
    u64 = np.uint64
    with np.errstate(over="ignore"):
        high = outer * u64(GAMMA)
        low = (inner + u64(1)) * u64(GAMMA) + u64(key)
    out = np.empty((outer.size, inner.size), dtype=np.int8)
    width = max(1, min(inner.size, block))
    height = max(1, block // width)
    words, scratch = np.empty(height * width, dtype=np.uint64), np.empty(height * width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in range(0, outer.size, height):
            tall = min(height, outer.size - p)
            for q in range(0, inner.size, width):
                wide = min(width, inner.size - q)
                z = words[: tall * wide].reshape(tall, wide)
                np.add(high[p : p + tall].reshape(-1, 1), low[q : q + wide].reshape(1, -1), out=z)
                _mix(z, scratch[: tall * wide].reshape(tall, wide), out[p : p + tall, q : q + wide])
    return out


def element_rows(seed: bytes, tag: str, rows: Sequence[int] | np.ndarray, n: int, *,
                 block: int = GENERATOR_BLOCK) -> np.ndarray:  # fmt: skip
    """Rows ``rows`` of the n×n matrix ``tag``: an int8 array of shape (len(rows), n)."""
    outer = np.asarray(rows, dtype=np.uint64).reshape(-1) * np.uint64(n)
    return _elements(matrix_key(seed, tag), outer, np.arange(n, dtype=np.uint64), block)


def element_cols(seed: bytes, tag: str, cols: Sequence[int] | np.ndarray, n: int, *,
                 block: int = GENERATOR_BLOCK) -> np.ndarray:  # fmt: skip
    """Columns ``cols`` of the n×n matrix ``tag``: an int8 array of shape (n, len(cols)), a transposed view of
    the columns built one after the other (each column contiguous: long blocks, few passes)."""
    inner = np.arange(n, dtype=np.uint64) * np.uint64(n)
    return _elements(matrix_key(seed, tag), np.asarray(cols, dtype=np.uint64).reshape(-1), inner, block).T


# ---- the generator (torch) -----------------------------------------------------------------------


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _torch_ternary(torch: Any, key: int, index: Any) -> Any:
    """The numpy generator's arithmetic in torch's int64 (wrapping multiplication; ``>>`` is arithmetic, so each shift is masked)."""

    def shr(z: Any, k: int) -> Any:
        return (z >> k) & ((1 << (64 - k)) - 1)

    z = (index + 1) * _signed(GAMMA) + _signed(key)
    z = (z ^ shr(z, 30)) * _signed(MIX1)
    z = (z ^ shr(z, 27)) * _signed(MIX2)
    z = z ^ shr(z, 31)
    return ((shr(z, 33) * 3) >> 31).to(torch.int8) - 1


def torch_rows(seed: bytes, tag: str, start: int, stop: int, n: int, *, device: Any = None) -> Any:
    """Rows ``start:stop`` of the matrix ``tag`` as a torch int8 tensor on ``device``."""
    import torch

    rows = torch.arange(start, stop, dtype=torch.int64, device=device).reshape(-1, 1)
    index = rows * n + torch.arange(n, dtype=torch.int64, device=device).reshape(1, -1)
    return _torch_ternary(torch, matrix_key(seed, tag), index)


def _torch_dtype(torch: Any, dtype: str) -> Any:
    return {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8": torch.float8_e4m3fn}[dtype]  # fmt: skip


def generate(seed: bytes, n: int, backend: str = "numpy", device: Any = None, *, dtype: str = "fp32",
             chunk_elements: int = 1 << 26) -> tuple[Any, Any]:  # fmt: skip
    """A and B of size n: int8 numpy arrays, or torch tensors in ``dtype`` on ``device`` built ``chunk_elements``
    at a time (the int64 temporaries of a chunk are 8 bytes an element)."""
    if backend == "numpy":
        everything = np.arange(n)
        return element_rows(seed, "A", everything, n), element_rows(seed, "B", everything, n)
    if backend != "torch":
        raise ValueError(f"backend {backend!r}: use 'numpy' or 'torch'")
    import torch

    kind = _torch_dtype(torch, dtype)
    step = max(1, chunk_elements // max(n, 1))
    out = []
    for tag in ("A", "B"):
        matrix = torch.empty((n, n), dtype=kind, device=device)
        for start in range(0, n, step):
            stop = min(n, start + step)
            matrix[start:stop] = torch_rows(seed, tag, start, stop, n, device=device).to(kind)
        out.append(matrix)
    return out[0], out[1]


# ---- the Merkle tree -----------------------------------------------------------------------------


def context(challenge_id: str, uuid: str) -> bytes:
    return hashlib.sha256(challenge_id.encode() + b"\x00" + uuid.encode()).digest()


def chunk_width(n: int) -> int:
    """K: the columns per chunk of an n-column row."""
    return min(CHUNK, n)


def chunk_count(n: int) -> int:
    return -(-n // chunk_width(n))


def leaf_hash(ctx: bytes, row: int, chunk: int, values: bytes | memoryview) -> bytes:
    """Chunk ``chunk`` of row ``row``: ``values`` its int32 LE bytes."""
    return hashlib.sha256(b"\x00" + ctx + row.to_bytes(8, "little") + chunk.to_bytes(8, "little") + values).digest()


def chunk_leaves(ctx: bytes, row: int, values: bytes) -> list[bytes]:
    """The chunk leaves of one row (``values``: the row as int32 LE)."""
    n = len(values) // 4
    width = 4 * chunk_width(n)
    view = memoryview(values)
    return [leaf_hash(ctx, row, k, view[start : start + width]) for k, start in enumerate(range(0, len(values), width))]


def row_hash(ctx: bytes, row: int, values: bytes) -> bytes:
    """Row ``row``'s leaf in the top tree: the Merkle root over its chunk leaves."""
    return merkle_root(chunk_leaves(ctx, row, values))


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first, root last (a one-element list)."""
    if not leaves:
        raise ValueError("a Merkle tree needs at least one leaf")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        above = [_node(below[k], below[k + 1]) for k in range(0, len(below) - 1, 2)]
        if len(below) % 2:
            above.append(below[-1])
        levels.append(above)
    return levels


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    return merkle_levels(leaves)[-1][0]


def merkle_proof(levels: Sequence[Sequence[bytes]], index: int) -> list[bytes]:
    """The siblings from leaf ``index`` up (a promoted node has none at its level)."""
    proof = []
    for level in levels[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            proof.append(level[sibling])
        index //= 2
    return proof


def proof_length(index: int, count: int) -> int:
    """How many siblings leaf ``index`` of a ``count``-leaf tree has (fewer than ⌈log₂ count⌉ where a node is
    promoted)."""
    length, width = 0, count
    while width > 1:
        length += (index ^ 1) < width
        index //= 2
        width = (width + 1) // 2
    return length


def proof_root(leaf: bytes, index: int, count: int, proof: Sequence[bytes]) -> bytes | None:
    """The root that ``proof`` leads to from ``leaf`` at ``index`` of a ``count``-leaf tree; None when the proof
    has not the tree's shape."""
    if not 0 <= index < count:
        return None
    node, width, used = leaf, count, 0
    while width > 1:
        sibling = index ^ 1
        if sibling < width:
            if used >= len(proof):
                return None
            node = _node(proof[used], node) if index % 2 else _node(node, proof[used])
            used += 1
        index //= 2
        width = (width + 1) // 2
    return node if used == len(proof) else None


def verify_proof(root: bytes, leaf: bytes, index: int, count: int, proof: Sequence[bytes]) -> bool:
    """Whether ``leaf`` is leaf ``index`` of the ``count``-leaf tree whose root is ``root``."""
    return proof_root(leaf, index, count, proof) == root


# ---- the host's side -----------------------------------------------------------------------------


@dataclass
class HostState:
    """One GPU's product and tree, kept between the commitment and the openings."""

    challenge_id: str
    uuid: str
    n: int
    rows: Any = field(repr=False)  # C: an int32 numpy array, or an fp32 torch tensor on the device
    levels: list[list[bytes]] = field(repr=False)
    seconds: dict[str, float]

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def rehash(self) -> None:
        """Commit again to ``rows`` as they are now (a simulated or tested host that tampered with C)."""
        ctx = context(self.challenge_id, self.uuid)
        self.levels = merkle_levels([row_hash(ctx, i, self.row_bytes(i)) for i in range(self.n)])

    def row_bytes(self, index: int) -> bytes:
        row: bytes = _int32_rows(self.rows[index : index + 1])[0].tobytes()
        return row


def _int32_rows(block: Any) -> np.ndarray:
    """Rows of C as a little-endian int32 numpy array: C is int32 on the CPU, and fp32 on a GPU (a second,
    int32 copy of C would not fit beside A and B), converted a block at a time."""
    if not isinstance(block, np.ndarray):  # torch
        import torch

        block = block.to(torch.int32).cpu().numpy()
    return np.ascontiguousarray(block, dtype="<i4")


def _multiply_torch(a: Any, b: Any, dtype: str) -> Any:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    # Split-K reductions in bf16/fp16 would round the integer partial sums: keep them in fp32.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if dtype == "fp8":
        one = torch.ones((), dtype=torch.float32, device=a.device)
        return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    if dtype in ("bf16", "fp16"):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, NotImplementedError, RuntimeError):  # no fp32 output here (an old torch, the CPU build): upcast
            return torch.mm(a.float(), b.float())
    return torch.mm(a, b)


def multiply_and_commit(seed: bytes, n: int, challenge_id: str, *, uuid: str = "", backend: str = "numpy",
                        device: Any = None, dtype: str = "fp32", memory_limit_bytes: int | None = None,
                        hash_chunk_rows: int = 1024) -> HostState:  # fmt: skip
    """Build A and B from ``seed``, compute C = A·B, hash C's rows and build the tree. ``MemoryShort`` when
    ``memory_limit_bytes`` (a simulated device's memory) or the device cannot hold A, B and C."""
    if not 0 < n <= MAX_N:
        raise ValueError(f"n = {n}: it must be between 1 and {MAX_N}")
    need = bytes_needed(n, dtype)
    if memory_limit_bytes is not None and need > memory_limit_bytes:
        raise MemoryShort(f"A, B and C at n = {n} take {need / 2**20:.1f} MiB; the device has {memory_limit_bytes / 2**20:.1f} MiB")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    if backend == "numpy":
        a, b = generate(seed, n)
        seconds["generate"] = time.perf_counter() - started
        c = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.int32)
        del a, b
    else:
        import torch

        try:
            a, b = generate(seed, n, "torch", device, dtype=dtype)
            if a.is_cuda:
                torch.cuda.synchronize(a.device)
            seconds["generate"] = time.perf_counter() - started
            c = _multiply_torch(a, b, dtype)  # fp32, exact integers
            del a, b
            if c.is_cuda:
                torch.cuda.synchronize(c.device)
        except torch.OutOfMemoryError as exc:
            raise MemoryShort(f"the device could not hold A, B and C at n = {n} ({need / 2**20:.0f} MiB): {exc}") from exc
    seconds["multiply"] = time.perf_counter() - started - seconds["generate"]
    hashed = time.perf_counter()
    ctx = context(challenge_id, uuid)
    leaves: list[bytes] = []
    for start in range(0, n, hash_chunk_rows):
        block = _int32_rows(c[start : start + hash_chunk_rows])
        leaves.extend(row_hash(ctx, start + k, block[k].tobytes()) for k in range(block.shape[0]))
    levels = merkle_levels(leaves)
    seconds["hash"] = time.perf_counter() - hashed
    return HostState(challenge_id, uuid, n, c, levels, seconds)


def encode_values(values: bytes) -> str:
    """A chunk's int32 LE values as sent: base64 of their low 3 bytes (int24 LE; |C_ij| ≤ n ≤ MAX_N < 2²³), 3/4 of
    int32 and a fixed size, so the openings' size is known from the format alone."""
    wide = np.frombuffer(values, dtype="<i4")
    return base64.b64encode(wide.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()).decode()


def decode_values(text: str, count: int) -> bytes:
    """The int32 LE bytes of an opened chunk of ``count`` values; ``ValueError`` when it holds another number."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 3 * count:
        raise ValueError(f"an opened chunk holds {len(raw) / 3:g} values, not {count}")
    narrow = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
    wide = np.empty((count, 4), dtype=np.uint8)
    wide[:, :3] = narrow
    wide[:, 3] = np.where(narrow[:, 2] & 0x80, 0xFF, 0)  # sign extension
    return wide.tobytes()


def encode_proof(proof: Sequence[bytes]) -> str:
    return base64.b64encode(b"".join(proof)).decode()


def decode_proof(text: str) -> list[bytes]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 32:
        raise ValueError(f"a proof of {len(raw)} bytes is not a list of SHA-256 hashes")
    return [raw[k : k + 32] for k in range(0, len(raw), 32)]


def open_chunks(state: HostState, asked: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The openings of one GPU's reveal (``{"rows": [i…], "chunks": [k…], …}``, one chunk per row): per row the
    chunk's values (``encode_values``), its proof inside the row (``chunk_proof``) and the row's proof in the
    top tree (``row_proof``), each a base64 of the concatenated sibling hashes."""
    rows, chunks = list(asked["rows"]), list(asked["chunks"])
    if len(rows) != len(chunks):
        raise ValueError(f"{len(rows)} rows but {len(chunks)} chunks asked")
    n, width = state.n, 4 * chunk_width(state.n)
    ctx = context(state.challenge_id, state.uuid)
    out = []
    for index, chunk in zip(rows, chunks, strict=True):
        if not 0 <= index < n or not 0 <= chunk < chunk_count(n):
            raise ValueError(f"row {index}, chunk {chunk} is not a chunk of an n = {n} product")
        values = state.row_bytes(index)
        proof = merkle_proof(merkle_levels(chunk_leaves(ctx, index, values)), chunk)
        out.append({"row": int(index), "chunk": int(chunk), "values": encode_values(values[chunk * width : (chunk + 1) * width]),
                    "chunk_proof": encode_proof(proof), "row_proof": encode_proof(merkle_proof(state.levels, index))})  # fmt: skip
    return out
