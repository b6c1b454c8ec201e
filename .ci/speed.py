"""A fixed amount of pure-Python work (a loop, JSON, SHA-256), timed: how fast this machine is right now
(docs/performance.md, the suite's runs of 2026-11-29). Lower is faster; one machine gave 0.38 s to 0.70 s within an
hour. Usage: python3 .ci/speed.py"""

import hashlib
import json
import time

started = time.perf_counter()
total = 0
for i in range(3_000_000):
    total += i * i % 7
document = {"k": [{"a": i, "b": str(i)} for i in range(20000)]}
for _ in range(5):
    json.loads(json.dumps(document))
for _ in range(20000):
    hashlib.sha256(b"x" * 1000).digest()
print(f"speed: {time.perf_counter() - started:.2f} s")
