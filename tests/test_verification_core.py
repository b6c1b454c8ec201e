"""The verification challenge's core (``shared/verification``, docs/verification.md): the generator is
deterministic, addressable and the same in numpy and torch; C is exact; Merkle proofs hold for every leaf and
fail for any other; ``verify`` passes an honest host and names each dishonest one's fault."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from master.services.hosts import challenge as protocol
from master.services.hosts.challenge import Reason
from shared.verification import compute

SEED = bytes(range(32))


def challenge_for(n_vram_mib: float = 4.0, *, uuids: tuple[str, ...] = ("GPU-a",), challenge_id: str = "ch-1",
                  seed: bytes = SEED) -> dict[str, Any]:  # fmt: skip
    return protocol.make_challenge(challenge_id=challenge_id, seed=seed, dtype="bf16", simulation=True,
                                   gpus=[{"uuid": u, "model_key": "h100-sxm", "vram_mib": n_vram_mib * protocol.SIM_VRAM_DIVISOR}
                                         for u in uuids])  # fmt: skip


def host(challenge: dict[str, Any], *, wrong: Any = None) -> dict[str, compute.HostState]:
    """An honest host's states (``wrong(state)`` tampers with C before it is hashed)."""
    states = {}
    for gpu in challenge["gpus"]:
        state = compute.multiply_and_commit(compute.gpu_seed(bytes.fromhex(challenge["seed"]), gpu["uuid"]), gpu["n"],
                                            challenge["challenge_id"], uuid=gpu["uuid"])  # fmt: skip
        if wrong is not None:
            wrong(state.rows)
            state.rehash()
        states[gpu["uuid"]] = state
    return states


def commitment_of(challenge: dict[str, Any], states: dict[str, compute.HostState]) -> dict[str, Any]:
    return {"challenge_id": challenge["challenge_id"], "gpus": {u: {"root": s.root.hex(), "n": s.n} for u, s in states.items()}}


def openings_of(reveal: dict[str, Any], states: dict[str, compute.HostState]) -> dict[str, Any]:
    return {"challenge_id": reveal["challenge_id"], "gpus": {u: compute.open_chunks(s, reveal["gpus"][u]) for u, s in states.items()}}


def run(challenge: dict[str, Any], states: dict[str, compute.HostState], *, rng_seed: int = 1, after: float = 1.0,
        **kw: Any) -> dict[str, protocol.Verdict]:  # fmt: skip
    reveal = protocol.choose_reveal(random.Random(rng_seed), challenge)
    return protocol.verify(challenge, commitment_of(challenge, states), reveal, openings_of(reveal, states),
                           committed_after_s=after, **kw)  # fmt: skip


# ---- the generator ---------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.binary(min_size=1, max_size=40), n=st.integers(1, 70), data=st.data())
def test_a_row_or_column_built_alone_is_that_of_the_whole_matrix(seed: bytes, n: int, data: st.DataObject) -> None:
    a, b = compute.generate(seed, n)
    rows = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))
    assert np.array_equal(compute.element_rows(seed, "A", rows, n), a[rows])
    assert np.array_equal(compute.element_cols(seed, "B", rows, n), b[:, rows])
    again, _ = compute.generate(seed, n)
    assert np.array_equal(a, again) and a.dtype == np.int8 and set(np.unique(a)) <= {-1, 0, 1}


def splitmix_element(seed: bytes, tag: str, index: int) -> int:
    """Element ``index`` (flat, i·n + j) of matrix ``tag`` as docs/verification.md writes it, in Python's integers."""
    mask = (1 << 64) - 1
    z = (compute.matrix_key(seed, tag) + (index + 1) * compute.GAMMA) & mask
    z = ((z ^ (z >> 30)) * compute.MIX1) & mask
    z = ((z ^ (z >> 27)) * compute.MIX2) & mask
    z ^= z >> 31
    return ((z >> 33) * 3 >> 31) - 1


@settings(max_examples=25, deadline=None)
@given(seed=st.binary(min_size=1, max_size=40), n=st.integers(1, 200), block=st.integers(1, 3000), data=st.data())
def test_the_generator_is_the_documented_splitmix64_at_any_block_size(seed: bytes, n: int, block: int, data: st.DataObject) -> None:
    """The numpy generator works a block at a time and skips splitmix64's last step (it never reaches the bits
    kept): every element is still the documented formula's, whatever the block."""
    rows = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))
    a = compute.element_rows(seed, "A", rows, n, block=block)
    b = compute.element_cols(seed, "B", rows, n, block=block)
    assert a.shape == (len(rows), n) and b.shape == (n, len(rows))
    for k, i in enumerate(rows):
        assert a[k].tolist() == [splitmix_element(seed, "A", i * n + j) for j in range(n)]
        assert b[:, k].tolist() == [splitmix_element(seed, "B", j * n + i) for j in range(n)]


@settings(max_examples=15, deadline=None)
@given(seed=st.binary(min_size=1, max_size=40), n=st.integers(1, 60))
def test_torch_builds_the_same_matrices_as_numpy(seed: bytes, n: int) -> None:
    a, b = compute.generate(seed, n)
    ta, tb = compute.generate(seed, n, "torch", "cpu", dtype="bf16", chunk_elements=97)
    assert torch.equal(ta.float(), torch.from_numpy(a).float()) and torch.equal(tb.float(), torch.from_numpy(b).float())


def test_the_values_are_balanced_and_the_tags_and_seeds_differ() -> None:
    a, b = compute.generate(SEED, 300)
    counts = np.bincount(a.ravel() + 1) / a.size
    assert np.all(np.abs(counts - 1 / 3) < 0.01), counts
    assert not np.array_equal(a, b)
    assert compute.gpu_seed(SEED, "GPU-a") != compute.gpu_seed(SEED, "GPU-b")


def test_c_is_exact_in_every_precision() -> None:
    """The product of ternary matrices in fp32 equals the int64 product; torch's bf16 inputs give the same C."""
    n = 257
    state = compute.multiply_and_commit(SEED, n, "ch", uuid="u")
    a, b = compute.generate(SEED, n)
    assert np.array_equal(state.rows, a.astype(np.int64) @ b.astype(np.int64))
    on_torch = compute.multiply_and_commit(SEED, n, "ch", uuid="u", backend="torch", device="cpu", dtype="bf16")
    assert on_torch.root == state.root


# ---- the Merkle tree -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 40), data=st.data())
def test_every_leaf_proves_and_nothing_else_does(count: int, data: st.DataObject) -> None:
    leaves = [bytes([k]) * 32 for k in range(count)]
    levels = compute.merkle_levels(leaves)
    root = compute.merkle_root(leaves)
    index = data.draw(st.integers(0, count - 1))
    proof = compute.merkle_proof(levels, index)
    assert compute.verify_proof(root, leaves[index], index, count, proof)
    assert not compute.verify_proof(root, b"\xff" * 32, index, count, proof)
    if count > 1:
        other = data.draw(st.integers(0, count - 1).filter(lambda k: k != index))
        assert not compute.verify_proof(root, leaves[index], other, count, proof)
        assert not compute.verify_proof(root, leaves[index], index, count, proof[:-1])
    assert not compute.verify_proof(root, leaves[index], index, count, [*proof, b"\x00" * 32])


# ---- sizes and deadlines ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "tf32", "bf16", "fp16", "fp8"])
def test_the_size_fills_at_least_90_percent_of_the_claimed_memory(dtype: str) -> None:
    for vram_mib in (12288, 81559, 143771):
        n = protocol.size_for(vram_mib, dtype)
        share = compute.bytes_needed(n, dtype) / (vram_mib * 2**20)
        assert 0.90 <= share < 0.91 and n % 8 == 0, (vram_mib, n, share)


def test_expected_rates_follow_the_datasheet_and_the_measured_sustained_share() -> None:
    assert protocol.expected_tflops("h200", "bf16") == pytest.approx(989 * 0.6, rel=0.02)
    assert protocol.expected_tflops("h200", "fp8") == pytest.approx(2 * 989 * 0.6, rel=0.02)
    assert protocol.expected_tflops("gtx-1080", "bf16") is None and protocol.expected_tflops("gtx-1080", "fp8") is None
    assert protocol.expected_tflops("no-such-gpu", "bf16") is None
    # C is fp32 (8 bytes an element in all at bf16): n ≈ 130k on an H200; at its slowest measured sustained
    # rate (587 TFLOP/s) the product takes ~7.5 s, well within the deadline
    n = protocol.size_for(143771, "bf16")
    assert 130000 < n < 131000
    product = 2 * n**3 / 587e12
    assert product * 1.4 < protocol.deadline_s(n, "h200", "bf16") - protocol.OVERHEAD_S < 120


def test_a_simulated_challenge_is_cpu_sized_and_reports_claimed_units() -> None:
    challenge = challenge_for(81559 / protocol.SIM_VRAM_DIVISOR)
    (gpu,) = challenge["gpus"]
    assert 600 <= gpu["n"] <= 1500 and challenge["deadline_s"] > protocol.OVERHEAD_S + 1
    states = host(challenge)
    (verdict,) = run(challenge, states, after=10.0).values()
    assert verdict.outcome == "passed" and verdict.reason is Reason.PASSED
    assert 0.9 * 81559 <= verdict.vram_mib <= 0.92 * 81559
    assert verdict.tflops == pytest.approx(2 * gpu["n"] ** 3 / 10.0 / 1e12 * protocol.SIM_TFLOPS_DIVISOR)


# ---- verify ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_gpus() -> tuple[dict[str, Any], dict[str, compute.HostState]]:
    challenge = challenge_for(uuids=("GPU-a", "GPU-b"))
    return challenge, host(challenge)


def test_an_honest_host_passes_on_every_gpu(two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:
    challenge, states = two_gpus
    assert states["GPU-a"].root != states["GPU-b"].root
    verdicts = run(challenge, states)
    assert {u: v.reason for u, v in verdicts.items()} == {"GPU-a": Reason.PASSED, "GPU-b": Reason.PASSED}


def test_one_wrong_entry_in_an_opened_row_is_caught() -> None:
    challenge = challenge_for()
    reveal = protocol.choose_reveal(random.Random(7), challenge)
    asked = reveal["gpus"]["GPU-a"]
    row, column = asked["rows"][3], asked["columns"][3][5]

    def tamper(c: np.ndarray) -> None:
        c[row, column] += 1

    states = host(challenge, wrong=tamper)
    (verdict,) = protocol.verify(challenge, commitment_of(challenge, states), reveal, openings_of(reveal, states),
                                 committed_after_s=1.0).values()  # fmt: skip
    assert verdict.reason is Reason.WRONG_RESULT and f"C[{row}, {column}]" in verdict.message


def test_skipped_rows_are_caught_with_the_stated_probability() -> None:
    """A host that left a fraction f of C's rows at zero escapes only when no opened row is one of them:
    hypergeometric, at most (1 - f)^s. Over 150 reveals (a fixed rng) the escapes match it."""
    challenge = challenge_for(0.5)
    n = challenge["gpus"][0]["n"]
    skipped = 12

    def skip(c: np.ndarray) -> None:
        c[-skipped:] = 0

    states = host(challenge, wrong=skip)
    commitment = commitment_of(challenge, states)
    rng = random.Random(2026)
    trials, escapes = 150, 0
    for _ in range(trials):
        reveal = protocol.choose_reveal(rng, challenge)
        (verdict,) = protocol.verify(challenge, commitment, reveal, openings_of(reveal, states), committed_after_s=1.0).values()
        assert verdict.reason in (Reason.PASSED, Reason.WRONG_RESULT)
        escapes += verdict.reason is Reason.PASSED
    s = protocol.ROWS
    exact = math.comb(n - skipped, s) / math.comb(n, s)
    assert exact <= (1 - skipped / n) ** s
    sigma = math.sqrt(trials * exact * (1 - exact))
    assert abs(escapes - trials * exact) <= 4 * sigma, (escapes, trials * exact)


def test_a_groups_rows_open_one_chunk_at_the_same_columns_and_groups_open_distinct_chunks() -> None:
    """At an H200's size the 32 rows fall into 8 groups of 4: a group's rows open one chunk and are checked at the
    same 8 columns of it, the groups' chunks differ, so the verifier builds 64 columns of B, not 256."""
    n = protocol.size_for(143771, "bf16")
    challenge = {"challenge_id": "c", "gpus": [{"uuid": "GPU-a", "n": n}]}
    asked = protocol.choose_reveal(random.Random(11), challenge)["gpus"]["GPU-a"]
    assert asked["rows"] == sorted(set(asked["rows"])) and len(asked["rows"]) == protocol.ROWS
    groups: dict[int, list[tuple[int, ...]]] = {}
    for chunk, columns in zip(asked["chunks"], asked["columns"], strict=True):
        assert len(columns) == protocol.COLUMNS and all(chunk * compute.CHUNK <= j < (chunk + 1) * compute.CHUNK for j in columns)
        groups.setdefault(chunk, []).append(tuple(columns))
    assert len(groups) == protocol.GROUPS
    assert all(len(members) == protocol.ROWS // protocol.GROUPS and len(set(members)) == 1 for members in groups.values())
    assert len({j for columns in asked["columns"] for j in columns}) == protocol.GROUPS * protocol.COLUMNS


def test_skipped_chunks_are_caught_with_the_stated_probability() -> None:
    """A host that left whole column chunks of C uncomputed escapes only when no group opens one of them. On 5
    chunks (fewer than the 8 groups, so each group draws its chunk alone) with 1 skipped that is (1 - 1/5)^8
    exactly; over 150 reveals (a fixed rng) the escapes match it."""
    n = 5 * compute.CHUNK
    challenge = {**challenge_for(), "gpus": [{"uuid": "GPU-a", "model_key": "h100-sxm", "n": n}]}
    skipped = 2  # the third chunk

    def skip(c: np.ndarray) -> None:
        c[:, skipped * compute.CHUNK : (skipped + 1) * compute.CHUNK] = 0

    states = host(challenge, wrong=skip)
    commitment = commitment_of(challenge, states)
    rng = random.Random(2027)
    trials, escapes = 150, 0
    for _ in range(trials):
        reveal = protocol.choose_reveal(rng, challenge)
        (verdict,) = protocol.verify(challenge, commitment, reveal, openings_of(reveal, states), committed_after_s=1.0).values()
        assert verdict.reason is (Reason.WRONG_RESULT if skipped in reveal["gpus"]["GPU-a"]["chunks"] else Reason.PASSED)
        escapes += verdict.reason is Reason.PASSED
    exact = (1 - 1 / 5) ** protocol.GROUPS
    sigma = math.sqrt(trials * exact * (1 - exact))
    assert abs(escapes - trials * exact) <= 4 * sigma, (escapes, trials * exact)


def test_at_an_h200s_size_skipped_chunks_escape_at_the_hypergeometric_rate() -> None:
    """With 255 chunks a row and a quarter of them skipped, a reveal misses every skipped chunk with probability
    C(255 - 64, 8) / C(255, 8) ≤ (3/4)^8 ≈ 10 % (the groups' chunks are distinct): so over 3000 reveals."""
    n = protocol.size_for(143771, "bf16")
    count = compute.chunk_count(n)
    challenge = {"challenge_id": "c", "gpus": [{"uuid": "GPU-a", "n": n}]}
    skipped = set(random.Random(5).sample(range(count), 64))
    rng = random.Random(2028)
    trials = 3000
    escapes = sum(not skipped & set(protocol.choose_reveal(rng, challenge)["gpus"]["GPU-a"]["chunks"]) for _ in range(trials))
    exact = math.comb(count - 64, protocol.GROUPS) / math.comb(count, protocol.GROUPS)
    assert exact <= (1 - 64 / count) ** protocol.GROUPS
    sigma = math.sqrt(trials * exact * (1 - exact))
    assert abs(escapes - trials * exact) <= 4 * sigma, (escapes, trials * exact)


def test_a_bad_proof_or_a_row_not_asked_is_refused(two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:
    challenge, states = two_gpus
    reveal = protocol.choose_reveal(random.Random(3), challenge)
    openings = openings_of(reveal, states)
    proof = compute.decode_proof(openings["gpus"]["GPU-a"][0]["row_proof"])
    openings["gpus"]["GPU-a"][0]["row_proof"] = compute.encode_proof([b"\x00" * 32, *proof[1:]])
    del openings["gpus"]["GPU-b"][-1]
    verdicts = protocol.verify(challenge, commitment_of(challenge, states), reveal, openings, committed_after_s=1.0)
    assert verdicts["GPU-a"].reason is Reason.BAD_PROOF and "does not match its committed root" in verdicts["GPU-a"].message
    assert verdicts["GPU-b"].reason is Reason.BAD_PROOF and "not the 32 asked" in verdicts["GPU-b"].message


def test_a_commitment_from_another_challenge_is_replayed(two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:
    """The old commitment as it was (its id), relabelled with the new id (its roots seen before, or its rows'
    leaves bound to the old id), or one GPU's answer given for another: never a pass."""
    old, states = two_gpus
    new = {**old, "challenge_id": "ch-2"}
    reveal = protocol.choose_reveal(random.Random(4), new)
    stale = commitment_of(old, states)
    verdicts = protocol.verify(new, stale, reveal, openings_of(reveal, states), committed_after_s=1.0)
    assert {v.reason for v in verdicts.values()} == {Reason.REPLAYED_COMMITMENT}
    relabelled = {**stale, "challenge_id": "ch-2"}
    seen = {entry["root"] for entry in stale["gpus"].values()}
    verdicts = protocol.verify(new, relabelled, reveal, openings_of(reveal, states), committed_after_s=1.0, seen_roots=seen)
    assert {v.reason for v in verdicts.values()} == {Reason.REPLAYED_COMMITMENT}
    verdicts = protocol.verify(new, relabelled, reveal, openings_of(reveal, states), committed_after_s=1.0)
    assert {v.reason for v in verdicts.values()} == {Reason.BAD_PROOF}
    swapped = {"challenge_id": "ch-1", "gpus": {"GPU-a": stale["gpus"]["GPU-b"], "GPU-b": stale["gpus"]["GPU-a"]}}
    reveal = protocol.choose_reveal(random.Random(4), old)
    crossed = {"gpus": {"GPU-a": compute.open_chunks(states["GPU-b"], reveal["gpus"]["GPU-a"]),
                        "GPU-b": compute.open_chunks(states["GPU-a"], reveal["gpus"]["GPU-b"])}}  # fmt: skip
    verdicts = protocol.verify(old, swapped, reveal, crossed, committed_after_s=1.0)
    assert {v.reason for v in verdicts.values()} == {Reason.BAD_PROOF}


def test_a_late_commitment_is_too_slow(two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:
    challenge, states = two_gpus
    assert {v.reason for v in run(challenge, states, after=challenge["deadline_s"]).values()} == {Reason.PASSED}
    verdicts = run(challenge, states, after=challenge["deadline_s"] + 0.01)
    assert {v.reason for v in verdicts.values()} == {Reason.TOO_SLOW}
    assert "deadline" in verdicts["GPU-a"].message


def test_memory_short_and_missing_answers_have_their_reasons() -> None:
    challenge = challenge_for()
    n = challenge["gpus"][0]["n"]
    with pytest.raises(compute.MemoryShort, match="the device has"):
        compute.multiply_and_commit(SEED, n, "ch-1", memory_limit_bytes=compute.bytes_needed(n, "bf16") - 1)
    reveal = protocol.choose_reveal(random.Random(5), challenge)
    short = {"challenge_id": "ch-1", "gpus": {"GPU-a": {"reason": "memory_short", "message": "only 2 MiB"}}}
    (verdict,) = protocol.verify(challenge, short, reveal, {}, committed_after_s=1.0).values()
    assert (verdict.outcome, verdict.reason, verdict.message) == ("failed", Reason.MEMORY_SHORT, "only 2 MiB")
    odd = {"challenge_id": "ch-1", "gpus": {"GPU-a": {"reason": "passed"}}}
    assert protocol.verify(challenge, odd, reveal, {}, committed_after_s=1.0)["GPU-a"].reason is Reason.WORKLOAD_FAILED
    nothing = {"challenge_id": "ch-1", "gpus": {}}
    assert protocol.verify(challenge, nothing, reveal, {}, committed_after_s=1.0)["GPU-a"].reason is Reason.NO_ANSWER
    states = host(challenge)
    (verdict,) = protocol.verify(challenge, commitment_of(challenge, states), reveal, {}, committed_after_s=1.0).values()
    assert verdict.reason is Reason.NO_ANSWER


def test_a_row_of_the_wrong_length_is_a_bad_proof() -> None:
    challenge = challenge_for()
    states = host(challenge)
    reveal = protocol.choose_reveal(random.Random(6), challenge)
    openings = openings_of(reveal, states)
    openings["gpus"]["GPU-a"][0]["values"] = compute.encode_values(b"\x00" * 8)
    (verdict,) = protocol.verify(challenge, commitment_of(challenge, states), reveal, openings, committed_after_s=1.0).values()
    assert verdict.reason is Reason.BAD_PROOF and "malformed" in verdict.message


def test_a_root_that_is_not_a_string_is_a_bad_proof() -> None:
    challenge = challenge_for()
    reveal = protocol.choose_reveal(random.Random(8), challenge)
    commitment = {"challenge_id": "ch-1", "gpus": {"GPU-a": {"root": ["not", "hex"]}}}
    (verdict,) = protocol.verify(challenge, commitment, reveal, {}, committed_after_s=1.0, seen_roots={"ab"}).values()
    assert verdict.reason is Reason.BAD_PROOF


# ---- the chunked openings ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(-compute.MAX_N, compute.MAX_N), min_size=1, max_size=50))
def test_an_opened_chunk_travels_as_int24_and_comes_back_as_its_int32_bytes(values: list[int]) -> None:
    raw = np.asarray(values, dtype="<i4").tobytes()
    text = compute.encode_values(raw)
    assert compute.decode_values(text, len(values)) == raw and len(text) == 4 * math.ceil(3 * len(values) / 3)
    with pytest.raises(ValueError, match="values, not"):
        compute.decode_values(text, len(values) + 1)


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 300), data=st.data())
def test_the_proof_length_is_known_from_the_index_and_the_count(count: int, data: st.DataObject) -> None:
    levels = compute.merkle_levels([bytes([k % 256]) * 32 for k in range(count)])
    index = data.draw(st.integers(0, count - 1))
    assert compute.proof_length(index, count) == len(compute.merkle_proof(levels, index))


def test_rows_are_cut_into_chunks_and_an_opening_is_one_chunk_of_each_asked_row(
        two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:  # fmt: skip
    challenge, states = two_gpus
    n = challenge["gpus"][0]["n"]
    assert n > compute.CHUNK and compute.chunk_count(n) == 2  # two chunks, the last one shorter
    reveal = protocol.choose_reveal(random.Random(9), challenge)
    asked = reveal["gpus"]["GPU-a"]
    assert len(asked["rows"]) == len(asked["chunks"]) == len(asked["columns"]) == protocol.ROWS
    for chunk, columns in zip(asked["chunks"], asked["columns"], strict=True):
        assert len(columns) == protocol.COLUMNS and all(chunk * compute.CHUNK <= j < min(n, (chunk + 1) * compute.CHUNK) for j in columns)
    items = compute.open_chunks(states["GPU-a"], asked)
    for item in items:
        width = min(n, (item["chunk"] + 1) * compute.CHUNK) - item["chunk"] * compute.CHUNK
        values = np.frombuffer(compute.decode_values(item["values"], width), dtype="<i4")
        assert np.array_equal(values, states["GPU-a"].rows[item["row"], item["chunk"] * compute.CHUNK :][:width])
    verdicts = protocol.verify(challenge, commitment_of(challenge, states), reveal, openings_of(reveal, states), committed_after_s=1.0)
    assert verdicts["GPU-a"].reason is Reason.PASSED and f"{protocol.ROWS * protocol.COLUMNS} entries" in verdicts["GPU-a"].message


def test_a_chunk_not_asked_or_proved_in_another_place_is_refused(two_gpus: tuple[dict[str, Any], dict[str, compute.HostState]]) -> None:
    """The other chunk of the row, opened honestly, is not the asked one; another row's chunk with its own chunk
    proof does not prove as the asked row's (its leaf binds its row); a chunk proof cut short does not prove."""
    challenge, states = two_gpus
    reveal = protocol.choose_reveal(random.Random(10), challenge)
    commitment = commitment_of(challenge, states)
    asked = reveal["gpus"]["GPU-a"]
    other = {**asked, "chunks": [1 - k for k in asked["chunks"]]}
    wrong_chunk = {"gpus": {"GPU-a": compute.open_chunks(states["GPU-a"], other), "GPU-b": compute.open_chunks(states["GPU-b"], reveal["gpus"]["GPU-b"])}}
    verdicts = protocol.verify(challenge, commitment, reveal, wrong_chunk, committed_after_s=1.0)
    assert verdicts["GPU-a"].reason is Reason.BAD_PROOF and "not chunk" in verdicts["GPU-a"].message
    assert verdicts["GPU-b"].reason is Reason.PASSED
    relabelled = openings_of(reveal, states)
    item = relabelled["gpus"]["GPU-a"][0]
    elsewhere = next(i for i in range(challenge["gpus"][0]["n"]) if i not in asked["rows"])
    honest = compute.open_chunks(states["GPU-a"], {"rows": [elsewhere], "chunks": [item["chunk"]]})[0]
    item.update(values=honest["values"], chunk_proof=honest["chunk_proof"])  # another row's chunk, its own chunk proof
    verdicts = protocol.verify(challenge, commitment, reveal, relabelled, committed_after_s=1.0)
    assert verdicts["GPU-a"].reason is Reason.BAD_PROOF and "does not match its committed root" in verdicts["GPU-a"].message
    short = openings_of(reveal, states)
    short["gpus"]["GPU-b"][0]["chunk_proof"] = ""
    verdicts = protocol.verify(challenge, commitment, reveal, short, committed_after_s=1.0)
    assert verdicts["GPU-b"].reason is Reason.BAD_PROOF and "does not match its committed root" in verdicts["GPU-b"].message


def test_eight_h200s_openings_fit_one_agent_frame_with_room_to_spare() -> None:
    """At an H200's bf16 size (n = 130 232), the openings of 8 GPUs, built from the format alone (values and
    sibling hashes of the right lengths, the deepest proofs, the largest indices), travel in one command result
    frame: under 1 MiB by ≥ 20 %, ≤ 100 KiB per GPU, and the agent protocol's decoder takes the frame."""
    from datetime import UTC, datetime

    from shared import protocol as agent_protocol

    n = protocol.size_for(143771, "bf16")
    width, count = compute.chunk_width(n), compute.chunk_count(n)
    chunk_depth = max(compute.proof_length(k, count) for k in range(count))
    row_depth = max(compute.proof_length(i, n) for i in range(n - 2048, n))
    assert (width, count, chunk_depth, row_depth) == (512, 255, 8, 17)
    item = {"row": n - 1, "chunk": count - 2, "values": compute.encode_values(bytes(4 * width)),
            "chunk_proof": compute.encode_proof([b"\xff" * 32] * chunk_depth), "row_proof": compute.encode_proof([b"\xff" * 32] * row_depth)}  # fmt: skip
    uuids = [f"GPU-{k:08x}-1111-2222-3333-444455556666" for k in range(8)]
    openings = {"challenge_id": "c" * 36, "gpus": {u: [item] * protocol.ROWS for u in uuids}}
    per_gpu = len(json.dumps([item] * protocol.ROWS, separators=(",", ":")))
    reply = agent_protocol.ChallengeOpened(challenge_id="c" * 36, openings=openings)
    frame = agent_protocol.encode(agent_protocol.CommandResult(
        host_id="h" * 36, seq=2**40, ts=datetime.now(UTC),
        body=agent_protocol.CommandResultBody(command_id="cmd-" + "0" * 32, ok=True, data=reply.model_dump(mode="json"), finished_at=datetime.now(UTC))))  # fmt: skip
    assert per_gpu <= 100 * 1024, per_gpu
    assert len(frame.encode()) <= 0.8 * agent_protocol.DEFAULT_MAX_FRAME, len(frame)
    assert agent_protocol.decode_agent_frame(frame).type == "command_result"
