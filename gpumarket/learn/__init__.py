"""Training the learned placer (issue 26, part 1): the simulator as a Gymnasium environment, Stable-Baselines3.

``env``      the placement environment (``PlacementEnv``): one episode is one arrival sequence on one fleet
``policies`` the per-candidate scorer in torch, as MaskablePPO's actor and DDPG's actor; export to numpy
``train``    ``train_placer``: ``gpumarket train-placer`` trains, exports and saves a policy

Needs the optional ``learn`` extra (``pip install 'gpumarket[learn]'``: gymnasium, stable-baselines3,
sb3-contrib, torch). Nothing the marketplace runs imports this package: the placer it trains runs in
numpy (``master.scheduler.placers.learned``). It sits in the assembly layer because it drives the
scheduler's simulator and placers from outside.
"""
