"""The placement algorithms: one module per algorithm, over ``base``'s shared machinery.

Every placer answers ``place(request, nodes) -> Placement | None`` under the same hard
constraints (``master.scheduler.fleet.fits``); they differ only in which feasible node and GPUs
they prefer. ``master.scheduler.registry`` names them (``PLACERS``, ``get_placer``).

Scores are "higher is better"; the algorithms marked *integer* score on the 0–100 integer
scale of the FGD authors' Kubernetes plugins, whose steps make near-equal placements equal.

``first_fit``       the first feasible node in the given order, its lowest-index GPUs (Greedy).
``best_fit``        the node left with the least free CPU and GPU,
                    ``0.5·cpu_free/max_cpu + 0.5·gpu_free/max_gpu`` smallest (the artifact's BestFit).
``random``          a uniformly random feasible node (seeded).
``utilization``     dot-product packing, *integer*: ``int(100·(1 − ⟨free, demand⟩/2))`` with both
                    vectors ``(cpu, gpu)`` normalised by the largest node — Tetris's alignment score
                    (Grandl et al., SIGCOMM 2014) as a most-allocated rule, as the FGD paper's
                    DotProd baseline runs it.
``gpu_packing``     *integer*: partly used GPUs first, then idle GPUs of used nodes, then empty
                    nodes (the artifact's GpuPacking).
``gpu_clustering``  *integer*: nodes running only tasks of the same GPU shape first, then mixed
                    ones, then empty ones (the artifact's GpuClustering).
``fgd``             *integer*: Fragmentation Gradient Descent (Weng et al., USENIX ATC 2023); the
                    math is in ``master.scheduler.fragmentation``.
``fgd_net``         our default: ``fgd`` less a penalty for GPU models that tasks restricted to
                    few models crowd (:func:`model_pressure`), and among equally scored
                    placements the host with the lowest latency to the renter's region.
``pwr_fgd``         ``fgd_net`` less a weighted penalty for the watts a placement adds
                    (``master.scheduler.power``), after PWR+FGD (Lettich et al., CCGrid 2025).
``fgd_plus``        ``fgd_net`` measured against every task shape of the workload with its host memory
                    (not only the 95 % most popular, by CPU and GPU), pulled towards fuller nodes (issue 43).
``learned_ppo``,    a small MLP shared across candidate nodes, trained by reinforcement learning
``learned_ddpg``    (MaskablePPO, DDPG) on the heterogeneous-clusters experiment, scoring features the
(``…_trace``)       heuristics compute (``master.scheduler.learned``); ``…_trace``: trained on the trace.

Imports ``shared`` and the rest of ``master.scheduler`` only; no database, no I/O.
"""
