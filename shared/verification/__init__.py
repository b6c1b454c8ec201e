"""Issue 40's GPU verification challenge (docs/verification.md): the host multiplies two seeded n×n ternary
matrices on every claimed GPU at once, commits to C with a two-level Merkle root (chunks of 512 columns within a
row, rows within the GPU) bound to the challenge, and opens one chunk of each row the master then picks; the master
recomputes some entries of each opened chunk from the seed (O(n) per row and column, never whole matrices) and
checks the proofs and the time.

This package is what both sides need: ``compute``, the generator (numpy, torch), the product and the Merkle tree
(stdlib + numpy; copied into the challenge image), and ``program``, the in-container entry point (``python3
/opt/gpumarket/verify/program.py /workspace``). The master's half (sizes, deadlines, the challenge, the reveal and
``verify`` with its ``Reason`` codes) is ``master.services.hosts.challenge``; nothing here imports it.
"""
