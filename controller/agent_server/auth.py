"""Who may call the two HTTP surfaces: a shared-secret bearer token.

Both the policy endpoint and every agent server refuse a request without the header
`Authorization: Bearer <token>` naming a token they accept: 401 with one line, before
the route, the body or the method is looked at (docs/agent_server.md, "Who may call",
has the threat model). Where a token comes from:

- the controller writes a fresh one per start into `RUN_DIR/agent_server.token`
  (`write_run_token`: created with mode 0600, never readable by others even for an
  instant), for its policy endpoint and the servers it starts, which get it in their
  environment (`TOKEN_ENV`), never on their command line (`ps` shows that to everyone);
- a server started elsewhere reads its token from `--token-file` (a file only its owner
  can read) or `TOKEN_ENV`; the controller reads the same file from that server's
  `environment.servers[].token_file`, and its policy endpoint accepts that token too.

Tokens are compared with `hmac.compare_digest` (no timing leak) and never logged.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
from collections.abc import Collection
from pathlib import Path

from rolloutdb.controller.agent_server.wire import HttpError
from rolloutdb.store import refuse_special_file, write_file_atomic

TOKEN_ENV = "ROLLOUTDB_AGENT_TOKEN"
# Printable ASCII without spaces, long enough not to be guessed; a generated token is 43 chars.
_TOKEN = re.compile(r"[!-~]{16,4096}")
SCHEME = "Bearer"


class TokenError(ValueError):
    """A token or token file that cannot be used (one line: what and how to fix it)."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def checked(token: str, where: str) -> str:
    token = token.strip()
    if not _TOKEN.fullmatch(token):
        raise TokenError(f"{where}: the token must be 16 to 4096 printable characters without spaces (e.g. "
                         "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def write_run_token(path: str | Path) -> str:
    """A fresh token at `path` (mode 0600 from its creation, replaced atomically)."""
    token = new_token()
    write_file_atomic(path, token + "\n", tag="token", mode=0o600)
    return token


def read_token_file(path: str | Path, where: str) -> str:
    """The token in `path`: a regular file that only its owner may read or write."""
    path = Path(path)
    try:
        refuse_special_file(path, TokenError)
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TokenError(f"{where}: {path} is not a regular file; give the file holding the token")
        if st.st_mode & 0o077:
            raise TokenError(f"{where}: {path} can be read or written by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise TokenError(f"{where}: {path} not found; give the file holding the token") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"{where}: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    return checked(text, f"{where} {path}")


def token_from_env() -> str | None:
    """`TOKEN_ENV`, taken out of the environment (a tool the server runs never inherits it)."""
    value = os.environ.pop(TOKEN_ENV, None)
    return None if value is None else checked(value, TOKEN_ENV)


def header(token: str) -> dict[str, str]:
    return {"Authorization": f"{SCHEME} {token}"}


def accepts(tokens: Collection[str], given: str) -> bool:
    """Whether `given` is one of `tokens`, in time independent of where they differ."""
    raw = given.encode("utf-8", "replace")
    found = False
    for token in tokens:  # every one compared: no early exit tells which matched
        found |= hmac.compare_digest(raw, token.encode())
    return found


def middleware(tokens: Collection[str]):
    """aiohttp middleware (inside `wire.error_middleware`): 401 unless the request carries
    one of `tokens`."""
    from aiohttp import web

    accepted = tuple(tokens)
    if not accepted or not all(_TOKEN.fullmatch(t) for t in accepted):
        raise TokenError("an HTTP surface needs at least one valid token (16 to 4096 printable characters)")

    @web.middleware
    async def check(request, handler):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != SCHEME.lower() or not given.strip():
            raise HttpError(401, "no bearer token: send the header 'Authorization: Bearer <token>' with the run's "
                                 "token (docs/agent_server.md#who-may-call)", headers={"WWW-Authenticate": SCHEME})
        if not accepts(accepted, given.strip()):
            raise HttpError(401, "wrong bearer token: send the token of this run (RUN_DIR/agent_server.token, or "
                                 "the server's --token-file)", headers={"WWW-Authenticate": SCHEME})
        return await handler(request)

    return check
