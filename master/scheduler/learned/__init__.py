"""The learned placer's numpy side: the features a placement is scored on and the shipped policies.

``features`` turns (node, request, fleet) into the few floats the learned scorer reads, built from
what the heuristics compute (FGD's fragmentation change, best fit, dot-product utilization, model
pressure, network slack); ``policy`` loads a trained scorer — a small MLP shared across candidate
nodes — from its ``.npz`` file and runs it in numpy. ``master.scheduler.placers.learned`` is the
placer over them. Training (Gymnasium, Stable-Baselines3, torch) lives in ``gpumarket.learn``:
nothing here imports it, so the marketplace needs numpy only.

Imports ``shared`` and the placement model only; no database, no I/O but reading a policy file.
"""
