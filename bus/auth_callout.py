"""Per-process NATS credentials, enforced by nats-server: the root issues each worker process a user
of its own and answers the server's auth callout for it with exactly that process's permissions.

Why a callout rather than users in the server's config: a worker's subjects name its instance id,
which is new at every start of its process (a restarted process is a new incarnation), and NATS
permissions match whole subject tokens, so no user written into the config in advance can be
limited to one incarnation's subjects. The callout needs no config reload: the server asks the
root (``$SYS.REQ.USER.AUTH``) when a client it does not know connects, and admits it with the
permissions of the signed user claims the root answers with (nats-server 2.10+, config mode:
``authorization { auth_callout { issuer, auth_users } }``; the issuer is this authority's account
key, written into the config the root renders for its embedded server).

The grants live in the root's memory, keyed by the child they were issued for: a restarted child
gets a new user and secret, and the old ones are no longer honoured. A request for a user this root
did not issue is not answered (another host's root, on a cluster, may own it); the server then
refuses the connection when its auth timeout ends. A known user with a wrong secret gets an
explicit refusal. Nothing here logs a secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import nkeys
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.subjects import AUTH_CALLOUT

log = logging.getLogger(__name__)

GLOBAL_ACCOUNT = "$G"  # config-mode users without accounts live in nats-server's global account
REQUEST_AUDIENCE = "nats-authorization-request"  # the "aud" of every callout request


class CalloutError(ValueError):
    """A callout request that is not one (not a JWT, not an authorization request)."""


@dataclass(frozen=True)
class Grant:
    """What one process may do on the bus: subjects (and ``subject queue`` pairs) it may publish
    to and subscribe to; everything else is a permissions violation."""

    owner: str  # the child it was issued for (a root child id)
    user: str
    secret: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True)
class AuthRequest:
    user_nkey: str  # the key the server made for this connection: the claims must name it
    server_id: str  # the server that asks: the answer's audience
    user: str
    password: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(signer: Any, claims: dict[str, Any]) -> str:
    """A NATS JWT (ed25519-nkey) of ``claims``, signed by ``signer`` (an nkeys KeyPair)."""
    claims = {"iat": int(time.time()), **claims}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode())
                                     .digest()).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


def decode_request(token: bytes) -> AuthRequest:
    """The fields of a server's authorization request that the answer needs. The request comes
    from the bus (only a user allowed to publish on the callout subject can send one), and all it
    can obtain is claims for a key the server made: its signature is not what protects anything."""
    try:
        claims = json.loads(_unb64(token.decode().split(".")[1]))
        nats = claims["nats"]
        if claims.get("aud") != REQUEST_AUDIENCE or nats.get("type") != "authorization_request":
            raise CalloutError("not an authorization request")
        opts = nats.get("connect_opts") or {}
        return AuthRequest(user_nkey=str(nats["user_nkey"]), server_id=str(nats["server_id"]["id"]),
                           user=str(opts.get("user") or ""), password=str(opts.get("pass") or ""))
    except CalloutError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CalloutError(f"malformed authorization request ({type(e).__name__})") from None


class WorkerAuthority:
    """The root's issuer of per-process credentials and its answer to the server's callout."""

    def __init__(self) -> None:
        self._issuer = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))
        self._by_user: dict[str, Grant] = {}
        self._by_owner: dict[str, str] = {}
        self._sub: Subscription | None = None

    @property
    def issuer(self) -> str:
        """The account public key the server's ``auth_callout.issuer`` must name."""
        return self._issuer.public_key.decode()

    def issue(self, owner: str, user: str, publish: list[str], subscribe: list[str]) -> str:
        """A new secret for ``user``, which replaces whatever ``owner`` was issued before."""
        self.revoke(owner)
        secret = secrets.token_urlsafe(32)
        self._by_user[user] = Grant(owner, user, secret, tuple(publish), tuple(subscribe))
        self._by_owner[owner] = user
        return secret

    def revoke(self, owner: str) -> None:
        user = self._by_owner.pop(owner, None)
        if user is not None:
            self._by_user.pop(user, None)

    def answer(self, req: AuthRequest) -> str | None:
        """The signed authorization response for ``req``, or None when the user is not ours."""
        g = self._by_user.get(req.user)
        if g is None:
            return None
        base = {"iss": self.issuer, "sub": req.user_nkey}
        if not hmac.compare_digest(g.secret.encode(), req.password.encode()):
            log.warning("bus auth callout: wrong secret for %s (child %s); refused", g.user, g.owner)
            nats_claims: dict[str, Any] = {"error": "wrong credentials"}
        else:
            user_jwt = encode_jwt(self._issuer, {**base, "name": g.user, "aud": GLOBAL_ACCOUNT, "nats": {
                "pub": {"allow": list(g.publish)}, "sub": {"allow": list(g.subscribe)},
                "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}})
            nats_claims = {"jwt": user_jwt}
        return encode_jwt(self._issuer, {**base, "aud": req.server_id, "nats": {
            **nats_claims, "type": "authorization_response", "version": 2}})

    async def serve(self, nc: Client) -> None:
        """Answer the callout on ``nc`` (the root's own connection, an ``auth_users`` member)."""
        async def handle(msg: Msg) -> None:
            try:
                reply = self.answer(decode_request(msg.data))
            except CalloutError as e:
                log.warning("bus auth callout: %s", e)
                return
            if reply is not None and msg.reply:
                await nc.publish(msg.reply, reply.encode())

        await self.stop()
        self._sub = await nc.subscribe(AUTH_CALLOUT, cb=handle)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as e:  # a closed connection: nothing to unsubscribe from
                log.debug("bus auth callout: unsubscribe: %s", e)
