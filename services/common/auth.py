"""Bearer-token authentication of gRPC calls: one shared secret per deployment.

Every internal gRPC server (tokenizer, vision encoder, prefill, decode) requires
``authorization: Bearer <STAGESERVE_INTERNAL_TOKEN>`` on every method except
``grpc.health.v1.Health/*`` (probes carry no credentials), and every internal client
sends it. The router's public ``Router`` service uses the same mechanism with the API
key instead. The secret is read once at start-up (``internal_credentials``) and passed
down as a ``Credentials``; nothing below reads it from the environment.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common.envs import API_KEY_ENV, INTERNAL_TOKEN_ENV, Envs

logger = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"  # gRPC metadata key and HTTP header, lower case as on the wire
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
INTERNAL = "internal credentials"
API_KEY = "API key"
NO_TOKEN_MESSAGE = (
    f"no internal token: set {INTERNAL_TOKEN_ENV} or pass --internal-token-file PATH "
    "(or --allow-unauthenticated to accept and send calls without credentials)"
)


class AuthConfigError(ValueError):
    """The secret a process was given cannot be used (missing, unreadable, not a header value)."""


@dataclass(frozen=True)
class Credentials:
    """A bearer secret: what clients send and servers require. ``repr`` never shows it.

    ``what`` names the kind of secret (``INTERNAL`` or ``API_KEY``) in error messages.
    """

    token: str = field(repr=False)
    what: str = INTERNAL

    def __post_init__(self) -> None:
        _check_token(self.token, self.what)

    @property
    def header_value(self) -> str:
        return f"Bearer {self.token}"

    @property
    def denied_message(self) -> str:
        """The UNAUTHENTICATED / 401 message: names the secret's kind, reveals nothing else."""
        return f"missing or invalid {self.what}"

    def accepts(self, header_value: str | bytes | None) -> bool:
        """Whether an ``authorization`` value is ``Bearer <token>`` (scheme case-insensitive)."""
        if header_value is None:
            return False
        raw = header_value.encode() if isinstance(header_value, str) else header_value
        scheme, _, presented = raw.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(presented, self.token.encode())


def _check_token(token: str, what: str) -> None:
    if not token:
        raise AuthConfigError(f"the {what} is empty")
    if not all(0x21 <= ord(ch) <= 0x7E for ch in token):
        raise AuthConfigError(f"the {what} must be printable ASCII without spaces")


def load_token_file(path: Path, what: str) -> str:
    """The secret stored in ``path``, surrounding whitespace stripped."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read the {what} file {path}: {exc}") from None
    if not token:
        raise AuthConfigError(f"the {what} file {path} is empty")
    return token


def internal_credentials(
    envs: Envs, token_file: Path | None, *, allow_unauthenticated: bool
) -> Credentials | None:
    """The internal token from ``token_file`` (wins) or ``envs.internal_token``.

    None (no authentication) only with ``allow_unauthenticated``, which logs one WARNING;
    otherwise a missing token raises ``AuthConfigError`` naming both ways to set it.
    """
    token = load_token_file(token_file, "internal token") if token_file else envs.internal_token
    if not token:
        if not allow_unauthenticated:
            raise AuthConfigError(NO_TOKEN_MESSAGE)
        logger.warning(
            "internal gRPC authentication is OFF (--allow-unauthenticated): "
            "any caller that reaches this process's ports is trusted"
        )
        return None
    try:
        credentials = Credentials(token)
    except AuthConfigError as exc:
        raise AuthConfigError(f"{INTERNAL_TOKEN_ENV} / --internal-token-file: {exc}") from None
    if allow_unauthenticated:
        logger.warning("--allow-unauthenticated has no effect: an internal token is set")
    return credentials


def child_environment(environ: Mapping[str, str], *, api_key: str | None = None) -> dict[str, str]:
    """The environment of ``stageserve up``'s children: ``environ`` plus the shared secrets.

    Keeps ``environ``'s internal token, else adds a fresh random one (the same for every
    child given this mapping); ``api_key`` (when given) becomes the router's API key.
    Secrets travel in the environment, never in argv (world-readable in /proc).
    """
    env = dict(environ)
    if not env.get(INTERNAL_TOKEN_ENV):
        env[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
    if api_key is not None:
        _check_token(api_key, API_KEY)
        env[API_KEY_ENV] = api_key
    return env


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects, with UNAUTHENTICATED, every call but health checks that lacks ``credentials``.

    A call must carry exactly one ``authorization`` value, ``Bearer <token>``. A rejected
    call's request is never read or deserialized; the status message says nothing about
    what was wrong (``Credentials.denied_message``).
    """

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_METHOD_PREFIXES):
            return handler  # None: UNIMPLEMENTED for anyone (method names are in the public protos)
        metadata = details.invocation_metadata or ()
        values = [value for key, value in metadata if key == AUTHORIZATION_KEY]
        if len(values) == 1 and self._credentials.accepts(values[0]):
            return handler
        return grpc.stream_stream_rpc_method_handler(self._reject)

    async def _reject(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._credentials.denied_message)
        yield  # unreachable: makes this a streaming handler that never reads the request
