"""Issue 40's GPU verification challenge (docs/verification.md): the host multiplies two seeded n×n ternary
matrices on every claimed GPU at once, commits to C's rows with a Merkle root bound to the challenge, and opens the
rows the master then picks; the master recomputes a block of those rows' entries from the seed (O(n) per row and
column, never whole matrices) and checks the proofs and the time.

``compute``: the generator (numpy, torch), the product and the Merkle tree (stdlib + numpy; copied into the
challenge image). ``protocol``: sizes, deadlines, the challenge, the reveal and ``verify`` with its ``Reason`` codes.
``program``: the in-container entry point (``python3 /opt/gpumarket/verify/program.py /workspace``).
"""
