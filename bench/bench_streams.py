"""Cost of the agent link's stream multiplexer (``shared.streams``) against plain byte copies, in one run.

* Throughput: ``--mb`` MB written in ``--chunk``-byte writes on ``--streams`` streams of one
  multiplexer, framed (``data_to_send``), decoded (``receive_frame``), read on the other side and
  granted back (WINDOW frames), all in this process; against a plain loop that copies the same
  chunks into a ``bytearray`` and reads them out again (the least any buffering layer does).
  Each is measured ``--rounds`` times, interleaved; the median counts.
* Interactive latency: 20 bulk streams keep their send buffers full; at random points of the
  rotation a 64-byte write is made on a 21st stream, and we count the frames and bytes that
  ``data_to_send`` hands out before it. An idle stream's write goes first; one that writes
  again before its turn in the rotation came back waits for that turn (at most one round of
  20 frames). Bytes before it / link speed bounds a keystroke's wait behind bulk copies on one
  link. Nothing here does I/O; only the CPU counts.

Usage: ``python bench/bench_streams.py [--mb N] [--chunk BYTES] [--streams S] [--rounds R] [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

from shared.streams import HEADER_SIZE, Multiplexer, decode_frame

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, quantile, record

MB = 1_000_000
BULK_STREAMS = 20
INTERACTIVE_SAMPLES = 200


def through_multiplexers(chunks: list[bytes], streams: int) -> float:
    """Seconds to move every chunk through two multiplexers, round-robin over ``streams`` streams."""
    sender = Multiplexer(initiator=True, max_send_buffer=1 << 20)
    receiver = Multiplexer(initiator=False)
    ids = [sender.open_stream() for _ in range(streams)]
    total = sum(map(len, chunks))
    received = 0
    pending = list(reversed(chunks))
    started = time.perf_counter()
    while received < total:
        for stream_id in ids:
            while pending and sender.writable(stream_id) >= len(pending[-1]):
                sender.send(stream_id, pending.pop())
        for frame in sender.data_to_send(max_bytes=1 << 20):
            receiver.receive_frame(frame)
        for stream_id in ids:
            while chunk := receiver.read(stream_id, 1 << 20):
                received += len(chunk)
        for frame in receiver.data_to_send():
            sender.receive_frame(frame)
        receiver.events()
        sender.events()
    return time.perf_counter() - started


def plain_copy(chunks: list[bytes], streams: int) -> float:
    """Seconds to copy every chunk into a buffer and read it out, with no framing or credit."""
    buffers = [bytearray() for _ in range(streams)]
    started = time.perf_counter()
    for index, chunk in enumerate(chunks):
        buffer = buffers[index % streams]
        buffer += chunk
        _ = bytes(buffer[: len(chunk)])
        del buffer[: len(chunk)]
    return time.perf_counter() - started


def interactive_wait(seed: int) -> tuple[list[int], list[int]]:
    """Frames and bytes handed out before a 64-byte interactive write, at random points of the bulk rotation."""
    rng = random.Random(seed)
    sender = Multiplexer(
        initiator=True, initial_window=1 << 30, max_send_buffer=1 << 20, max_link_buffer=1 << 40
    )
    bulk = [sender.open_stream() for _ in range(BULK_STREAMS)]
    interactive = sender.open_stream()
    sender.data_to_send()
    frames_before: list[int] = []
    bytes_before: list[int] = []
    for _ in range(INTERACTIVE_SAMPLES):
        for stream_id in bulk:  # keep every bulk stream full
            sender.send(stream_id, b"b" * sender.writable(stream_id))
        sender.data_to_send(max_bytes=rng.randrange(1, 2 << 20))  # stop the rotation somewhere
        sender.send(interactive, b"k" * 64)
        frames, queued = 0, 0
        while True:
            batch = sender.data_to_send(max_bytes=256 * 1024)
            hit = next(
                (i for i, frame in enumerate(batch) if decode_frame(frame).stream_id == interactive), None
            )
            if hit is not None:
                frames += hit
                queued += sum(map(len, batch[:hit]))
                break
            frames += len(batch)
            queued += sum(map(len, batch))
        frames_before.append(frames)
        bytes_before.append(queued)
    return frames_before, bytes_before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, default=64, help="MB moved per measurement (default 64)")
    parser.add_argument(
        "--chunk", type=int, default=16 * 1024, help="bytes per application write (default 16384)"
    )
    parser.add_argument("--streams", type=int, default=4, help="streams sharing the link (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each (default 5)")
    parser.add_argument("--quick", action="store_true", help="8 MB × 2 rounds (for make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rounds = 8, 2
    if args.mb < 1 or args.chunk < 1 or args.streams < 1 or args.rounds < 1:
        parser.error("every argument must be at least 1")
    print(describe_machine())
    payload = os.urandom(args.chunk)
    chunks = [payload] * (args.mb * MB // args.chunk)
    size = sum(map(len, chunks)) / MB
    print(
        f"throughput: {size:.0f} MB in {len(chunks):,} writes of {args.chunk:,} bytes over {args.streams} streams, "
        f"{args.rounds} rounds interleaved, median; frames of up to 64 KiB + {HEADER_SIZE} bytes of header"
    )
    muxed: list[float] = []
    copied: list[float] = []
    for _ in range(args.rounds):
        gc.collect()
        copied.append(plain_copy(chunks, args.streams))
        gc.collect()
        muxed.append(through_multiplexers(chunks, args.streams))
    copy_rate = size / statistics.median(copied)
    mux_rate = size / statistics.median(muxed)
    print(f"  {'plain bytearray copy loop (baseline)':<46} {copy_rate:>9,.0f} MB/s")
    print(
        f"  {'send → frames → receive_frame → read + WINDOW':<46} {mux_rate:>9,.0f} MB/s"
        f"  {copy_rate / mux_rate:.1f}× the baseline's time"
    )
    record("streams", f"{size:.0f} MB through two multiplexers, {args.chunk:,}-byte writes on {args.streams} streams",
           mux_rate, "MB/s", "plain bytearray copy loop", copy_rate)  # fmt: skip

    frames_before, bytes_before = interactive_wait(seed=1)
    worst = max(bytes_before)
    print(
        f"\ninteractive: a 64-byte write beside {BULK_STREAMS} full bulk streams, {INTERACTIVE_SAMPLES} samples at random "
        f"points of the rotation"
    )
    print(
        f"  frames before it: p50 {quantile(frames_before, 0.5):.0f}, p99 {quantile(frames_before, 0.99):.0f}, "
        f"max {max(frames_before)} "
        f"(one round is {BULK_STREAMS} frames)"
    )
    print(
        f"  bytes before it:  p50 {quantile(bytes_before, 0.5):,.0f}, p99 {quantile(bytes_before, 0.99):,.0f}, "
        f"max {worst:,} "
        f"= {worst / (100 * MB) * 1e3:.1f} ms on a 100 MB/s link, {worst / (1000 * MB) * 1e3:.2f} ms at 1 GB/s"
    )
    record("streams", f"frames queued before a 64-byte write beside {BULK_STREAMS} full bulk streams, max",
           max(frames_before), "frames", note=f"p50 {quantile(frames_before, 0.5):.0f}; one round is {BULK_STREAMS} frames")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
