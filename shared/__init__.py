"""Code every gpumarket component imports: wire protocol, errors, settings, crypto, bus.

Must not import from agent/, access/, master/, console/ or billing/.
"""
