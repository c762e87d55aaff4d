"""What a process opens beyond loopback, and the rules for it: checked once at start-up.

The public API without a key may listen on loopback only, unless the operator says
``--insecure-no-api-key`` (``check_api_exposure``; the router and ``stageserve up`` both
apply it). Mooncake cannot be kept on loopback (``MOONCAKE_EXPOSURE``), so ``up`` refuses
it on a loopback ``--host`` and warns on any other (``check_transfer_exposure``). Kept free
of heavy imports: the ``stageserve`` command line reads it.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from services.common.envs import API_KEY_ENV

logger = logging.getLogger(__name__)

INSECURE_NO_API_KEY_FLAG = "--insecure-no-api-key"
MOONCAKE_EXPOSURE = (
    "Mooncake 0.3.13 listens on every interface (its handshake port on 0.0.0.0, its TCP data "
    "port on [::]) whatever host it is given, and authenticates nothing: whoever reaches those "
    "ports can read and write the registered KV pages and embedding rows"
)


class ExposureError(ValueError):
    """A start-up configuration would open a port beyond what its flags promise."""


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (``localhost``, 127/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, "0.0.0.0", "::" and the like: other interfaces may be reached


def check_api_exposure(hosts: Iterable[str], has_api_key: bool, insecure: bool) -> None:
    """The public API without a key listens on loopback addresses only, unless ``insecure``
    (``--insecure-no-api-key``) says so on purpose (one WARNING then); ``ExposureError``
    naming both ways out otherwise."""
    exposed = [host for host in dict.fromkeys(hosts) if not is_loopback_host(host)]
    if has_api_key or not exposed:
        return
    if not insecure:
        raise ExposureError(
            f"the API would listen on {', '.join(exposed)} (not loopback only) without an API "
            f"key: set one with --api-key or {API_KEY_ENV}, or pass {INSECURE_NO_API_KEY_FLAG} "
            "to serve it open on purpose"
        )
    logger.warning(
        "%s: the API listens on %s without an API key; anyone who reaches it may call it",
        INSECURE_NO_API_KEY_FLAG,
        ", ".join(exposed),
    )


def check_transfer_exposure(host: str, backends: Iterable[str]) -> str | None:
    """For services that all bind ``host`` and move tensors with ``backends``:
    ``ExposureError`` when ``host`` is loopback and Mooncake is among them, the warning to
    print when ``host`` is not, None without Mooncake."""
    if "mooncake" not in set(backends):
        return None
    if is_loopback_host(host):
        raise ExposureError(
            f"the mooncake transfer backend cannot stay on --host {host}: {MOONCAKE_EXPOSURE}; "
            "on one host use shm (no port); across hosts, give a non-loopback --host and "
            "fence Mooncake's ports off (firewall, NetworkPolicy)"
        )
    return f"{MOONCAKE_EXPOSURE}; fence those ports off (firewall, NetworkPolicy)"
