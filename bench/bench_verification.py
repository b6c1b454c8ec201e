"""The GPU verification challenge's cost (issue 40, docs/verification.md): the host's work against the verifier's.

At each size n, on this CPU, in one run:

* host: ``compute.multiply_and_commit`` (build A and B from the seed, C = A·B in fp32, hash C's rows into the
  Merkle tree), the work a challenged GPU does;
* verifier: ``protocol.choose_reveal`` + ``protocol.verify`` of an honest host's commitment and openings (one
  chunk of each of 32 rows with its two-level proof; the rows in 8 groups of 4 that open the same chunk, 8
  entries of each opened chunk, the same 8 columns in a group, recomputed from the seed), the master's work;
* baseline: numpy's float32 matmul of two n × n matrices alone (what the host's product costs without the
  challenge's generation and hashing).

The goal is verifier < 1 % of host. The verifier's work grows like n, the host's like n³, so the ratio falls
with n; the last line times the verifier's arithmetic at the H200's bf16 challenge size (n ≈ 130 200), whose
product alone is ~7.5 s on that GPU (docs/verification-measurements.md). Each figure is the median of
``--rounds`` runs.

Usage: ``python bench/bench_verification.py [--sizes 512 1024 2048 4096] [--rounds 3] [--quick]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from master.services.hosts import challenge as protocol
from shared.verification import compute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, record

SEED = bytes(range(32))
H200_BF16_N = protocol.size_for(143771, "bf16")


def median_s(run: Callable[[], object], rounds: int) -> float:
    """The median of ``rounds`` timed runs after one untimed (caches, BLAS threads, first-call costs)."""
    run()
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def one_size(n: int, rounds: int) -> tuple[float, float, float]:
    """Seconds: the host's work, the verifier's, numpy's matmul alone."""
    uuid = "GPU-bench"
    challenge = {"challenge_id": "bench", "seed": SEED.hex(), "dtype": "fp32", "deadline_s": 1e9,
                 "gpus": [{"uuid": uuid, "n": n}], "scale": {"vram": 1, "tflops": 1.0}}  # fmt: skip
    seed = compute.gpu_seed(SEED, uuid)
    states: list[compute.HostState] = []
    host = median_s(lambda: states.append(compute.multiply_and_commit(seed, n, "bench", uuid=uuid)), rounds)
    state = states[-1]
    commitment = {"challenge_id": "bench", "gpus": {uuid: {"root": state.root.hex(), "n": n}}}
    rng = random.Random(1)
    reveals = [protocol.choose_reveal(rng, challenge) for _ in range(rounds + 1)]
    openings = [{"gpus": {uuid: compute.open_chunks(state, r["gpus"][uuid])}} for r in reveals]
    verdicts: list[str] = []
    turn = iter(range(rounds + 1))

    def verifier() -> None:
        k = next(turn)
        protocol.choose_reveal(rng, challenge)
        verdict = protocol.verify(challenge, commitment, reveals[k], openings[k], committed_after_s=1.0)[uuid]
        verdicts.append(verdict.reason)

    verify = median_s(verifier, rounds)
    assert set(verdicts) == {protocol.Reason.PASSED}, verdicts
    generator = np.random.default_rng(0)
    a, b = generator.standard_normal((n, n), dtype=np.float32), generator.standard_normal((n, n), dtype=np.float32)
    matmul = median_s(lambda: a @ b, rounds)
    return host, verify, matmul


def verifier_at(n: int, rounds: int) -> float:
    """The verifier's arithmetic at size n without a host: 32 rows of A, the 8 columns of B of each of the 8
    groups' opened chunks (64 columns), their 256 entries, and the 32 chunks' leaf hashes and two-level proofs
    (random stand-ins for the values and the siblings)."""
    challenge = {"challenge_id": "bench", "gpus": [{"uuid": "GPU-bench", "n": n}]}
    asked = protocol.choose_reveal(random.Random(2), challenge)["gpus"]["GPU-bench"]
    width, count = compute.chunk_width(n), compute.chunk_count(n)
    values = np.random.default_rng(4).integers(-200, 200, size=(protocol.ROWS, width), dtype=np.int32)
    sibling = hashlib.sha256(b"sibling").digest()
    ctx = compute.context("bench", "GPU-bench")
    encoded = [compute.encode_values(values[k].tobytes()) for k in range(protocol.ROWS)]  # the host's part
    proofs = [(compute.encode_proof([sibling] * compute.proof_length(chunk, count)), compute.encode_proof([sibling] * compute.proof_length(row, n)))
              for row, chunk in zip(asked["rows"], asked["chunks"], strict=True)]  # fmt: skip

    def work() -> None:
        for k, (row, chunk) in enumerate(zip(asked["rows"], asked["chunks"], strict=True)):  # as protocol.verify
            leaf = compute.leaf_hash(ctx, row, chunk, compute.decode_values(encoded[k], width))
            node = compute.proof_root(leaf, chunk, count, compute.decode_proof(proofs[k][0]))
            compute.verify_proof(leaf, node or leaf, row, n, compute.decode_proof(proofs[k][1]))
        protocol.checked_entries(SEED, n, asked["rows"], asked["columns"])

    return median_s(work, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="n (default 512 1024 2048 4096)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each measurement (default 3)")
    parser.add_argument("--quick", action="store_true", help="n = 256 and 512, 2 rounds (seconds; make bench QUICK=1)")
    args = parser.parse_args()
    sizes: list[int] = [256, 512] if args.quick else args.sizes
    rounds: int = 2 if args.quick else args.rounds
    if rounds < 1 or min(sizes) < protocol.ROWS:
        parser.error(f"--rounds must be at least 1 and every size at least {protocol.ROWS}")

    print(describe_machine())
    print(f"s = {protocol.ROWS} rows opened, one chunk of K = {compute.CHUNK} columns each, in g = {protocol.GROUPS} groups "
          f"sharing their chunk and its t = {protocol.COLUMNS} checked columns; median of {rounds} runs")
    print(f"{'n':>6} {'host (gen+mul+hash)':>20} {'numpy matmul':>13} {'verifier':>10} {'verifier/host':>14}")
    for n in sizes:
        host, verify, matmul = one_size(n, rounds)
        print(f"{n:>6} {host * 1e3:>17.1f} ms {matmul * 1e3:>10.1f} ms {verify * 1e3:>7.2f} ms {verify / host:>13.2%}")
        record("verification", f"host's work at n = {n} (generate, multiply, hash)", host * 1e3, "ms",
               "numpy float32 matmul alone", matmul * 1e3)  # fmt: skip
        record("verification", f"verifier's work at n = {n} (choose_reveal + verify)", verify * 1e3, "ms",
               "the host's work", host * 1e3)  # fmt: skip
    big = verifier_at(H200_BF16_N, rounds)
    product = 2 * H200_BF16_N**3 / 587e12
    print(f"verifier's arithmetic at the H200's bf16 size n = {H200_BF16_N}: {big * 1e3:.0f} ms on this CPU, "
          f"{big / product:.2%} of that GPU's product alone ({product:.1f} s at its measured 587 TFLOP/s)")  # fmt: skip
    record("verification", f"verifier's arithmetic at n = {H200_BF16_N} (an H200's bf16 challenge)", big * 1e3, "ms",
           "the H200's product alone (measured rate)", product * 1e3)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
