"""Is there a Dask scheduler at this address? One bounded question before a ``Client`` connects.

A ``distributed.Client`` pointed at something that is not an answering Dask scheduler does not
fail within its ``timeout``: a scheduler that hangs (stopped, swapping) or any server that
accepts the connection and never answers (the scheduler's dashboard port, a web server) holds
its handshake for minutes, and one that answers in another protocol has its reply read as a
frame length (a multi-exabyte allocation). One ``identity`` call under ``asyncio.wait_for``
tells these apart, in time, and says which it was.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor

#: where a client's TLS settings come from (what ``Security()`` reads)
TLS_SETTINGS = ("DASK_DISTRIBUTED__COMM__TLS__CA_FILE, DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT and "
                "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY (or distributed.comm.tls.* in Dask's configuration)")
HINT = ("check the address: the scheduler listens on tcp://HOST:8786 unless started with --port, "
        "and 8787 is its dashboard, not the scheduler")


class SchedulerUnreachable(ConnectionError):
    """Nothing at the address answered as a Dask scheduler in time; the message says what did."""


def probe_scheduler(address: str, timeout: float) -> None:
    """Return once ``address`` answers as a Dask scheduler within ``timeout`` s; else raise
    :class:`SchedulerUnreachable` (``ValueError`` for an address Dask cannot parse).

    TLS settings come from Dask's configuration, as the ``Client``'s do.
    """
    from distributed.core import rpc
    from distributed.security import Security

    try:
        args = Security().get_connection_args("client")
    except (OSError, ValueError) as exc:  # a TLS file missing or unreadable (ssl.SSLError is an OSError)
        raise SchedulerUnreachable(
            f"this process's Dask TLS client settings cannot be used ({type(exc).__name__}: {exc}); check the "
            f"files that {TLS_SETTINGS} name") from None
    if str(address).startswith("tls://") and args.get("ssl_context") is None:
        # Dask refuses this before connecting, with a TypeError that reads as a wrong answer
        raise SchedulerUnreachable(
            f"{address!r} is a TLS address, but this process has no TLS client settings: set {TLS_SETTINGS} "
            "to the team CA's files, as docs/runtime.md ('A pool that is safe to expose') shows")

    started = time.monotonic()
    refused = _refused(address, timeout)
    if refused is not None:  # Dask's own connect retries a refusal until the timeout, then says only "timed out"
        raise SchedulerUnreachable(f"nothing listens at {address!r} ({refused}): no scheduler is running there; "
                                   f"{HINT}")
    asked, timeout = timeout, max(timeout - (time.monotonic() - started), 0.5)  # the whole probe within it

    async def identity() -> object:
        remote = rpc(address, timeout=timeout, connection_args=args)
        try:
            return await asyncio.wait_for(remote.identity(), timeout)
        finally:
            await remote.close_rpc()

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            who = asyncio.run(identity())
        else:  # called from async code (an async flow): a loop of its own, in a thread of its own
            with ThreadPoolExecutor(1) as pool:
                who = pool.submit(lambda: asyncio.run(identity())).result()
    except (asyncio.TimeoutError, TimeoutError):
        raise SchedulerUnreachable(f"nothing at {address!r} answered as a Dask scheduler within {asked:g} s "
                                   f"(a scheduler that is down or hung, another service, or a scheduler that "
                                   f"speaks TLS: its address starts with tls://); {HINT}") from None
    except OSError as exc:
        tls = "" if str(address).startswith("tls://") else " (a scheduler started with TLS needs a tls:// address)"
        raise SchedulerUnreachable(f"cannot reach the Dask scheduler at {address!r} ({exc}); is it running?{tls} "
                                   f"{HINT}") from None
    except ValueError as exc:  # a malformed address: Dask's own message says what is wrong with it
        raise ValueError(f"{address!r} is not a Dask scheduler address ({exc}); {HINT}") from None
    except Exception as exc:  # noqa: BLE001 - another protocol's reply surfaces as anything from MemoryError down
        # another protocol's first bytes read as a Dask frame length ask for exabytes: that
        # MemoryError says nothing about this machine's memory, so it is not shown
        detail = ("its reply was not a Dask message" if isinstance(exc, MemoryError)
                  else f"{type(exc).__name__}: {str(exc)[:200]}")
        raise SchedulerUnreachable(f"{address!r} answered, but not as a Dask scheduler ({detail}); {HINT}") from None
    if not isinstance(who, dict) or who.get("type") != "Scheduler":
        kind = who.get("type") if isinstance(who, dict) else type(who).__name__
        raise SchedulerUnreachable(f"{address!r} is a Dask {kind}, not the scheduler; {HINT}")


def _refused(address: str, timeout: float) -> str | None:
    """The refusal of a plain TCP connection to ``address``'s host and port, said at once (a
    review waited out ``gogh pool status``'s 10 s for a port where nothing listened); None for
    anything else (it connected, timed out, or the address is not asked), which the identity
    question then tells apart.

    Asked only of a ``tcp://`` address whose host is an IP address or ``localhost``: a name's
    lookup has no bound here, and a ``tls://`` scheduler logs a failed handshake for every bare
    connection.
    """
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(str(address))
        if scheme != "tcp":
            return None
        host, port = parse_host_port(location)
        if host != "localhost":
            ipaddress.ip_address(host)
    except (ValueError, TypeError):
        return None  # a name, or what the identity question says is wrong with it
    try:
        with socket.create_connection((host, port), timeout=min(timeout, 2.0)):
            return None
    except ConnectionRefusedError as exc:
        return exc.strerror or "connection refused"
    except OSError:
        return None


__all__ = ["HINT", "TLS_SETTINGS", "SchedulerUnreachable", "probe_scheduler"]
