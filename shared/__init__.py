"""Code every gpumarket component imports: the wire protocol, errors, settings, crypto, the bus, the
edge registry, rate limits, ids and clocks.

The bottom layer: imports nothing of ours (never agent/, access/, master/, console/ or billing/).
"""
