"""The programs a member's network is made with (``ip``, ``nsenter``, ``iptables-restore``, ``sysctl``, ``wg``), run
one way: an argument list (never a shell), a deadline, and a failure as ``ClusterNetworkError`` naming the command."""

from __future__ import annotations

import asyncio

from agent.cluster.wgcontrol import ClusterNetworkError


async def run(*argv: str, stdin: bytes | None = None, timeout: float = 10.0, check: bool = True) -> tuple[int, bytes]:
    """Run ``argv`` with ``stdin`` (``None``: nothing): its exit status and output. With ``check`` a non-zero status raises
    ``ClusterNetworkError`` with the command and its error output; a command past ``timeout`` is killed and raises.
    Cancelling is safe: the process is killed with its waiter."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate(stdin)
    except BaseException as exc:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if isinstance(exc, TimeoutError):
            raise ClusterNetworkError(f"{argv[0]} did not finish within {timeout:g}s") from None
        raise
    if check and process.returncode != 0:
        raise ClusterNetworkError(f"{' '.join(argv[:6])}… failed: {err.decode(errors='replace').strip()[:300]}")
    return process.returncode or 0, out
