"""How a service proves itself to NATS: user/password, an NKEY/JWT creds file, TLS.

The options come from `--nats-user`, `--nats-password`, `--nats-creds`, `--nats-tls-ca`
(or their `TANDEM_NATS_*` environment variables: the launcher and compose pass secrets
through the environment, never on a command line that `ps` shows). `connect_kwargs` turns
them into nats-py's keyword arguments.
"""

from __future__ import annotations

import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.bus.permissions import ROLES, inbox_prefix, user_block
from shared.errors import TandemError

# The password .env.example ships with: a stack started with it has the one NATS credential
# every reader of this repository knows. Services refuse it.
EXAMPLE_PASSWORD = "change-me-before-exposing-anything"  # noqa: S105 (a value to refuse)


@dataclass(frozen=True)
class BusAuth:
    user: str | None = None
    password: str | None = None
    creds_file: str | None = None  # NKEY/JWT `.creds` file (NATS decentralised auth)
    tls_ca: str | None = None  # CA bundle: connect with TLS and verify the server

    @classmethod
    def from_args(cls, args: Any) -> BusAuth:
        return cls(
            user=getattr(args, "nats_user", None) or None,
            password=getattr(args, "nats_password", None) or None,
            creds_file=getattr(args, "nats_creds", None) or None,
            tls_ca=getattr(args, "nats_tls_ca", None) or None,
        )

    @classmethod
    def generate(cls, user: str = "tandem") -> BusAuth:
        """Fresh per-run credentials for an embedded nats-server."""
        return cls(user=user, password=secrets.token_urlsafe(24))

    def connect_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if (self.user is None) != (self.password is None):
            raise TandemError("--nats-user and --nats-password go together")
        if self.password == EXAMPLE_PASSWORD:
            raise TandemError(
                "the NATS password is .env.example's: set your own NATS_PASSWORD in .env "
                '(e.g. echo "p$(openssl rand -hex 24)")'
            )
        if self.user is not None:
            out["user"] = self.user
            out["password"] = self.password
            if self.user in ROLES:  # a role's identity may read replies on its inbox only
                out["inbox_prefix"] = inbox_prefix(self.user)
        if self.creds_file is not None:
            if not Path(self.creds_file).is_file():
                raise TandemError(f"--nats-creds: no such file {self.creds_file}")
            out["user_credentials"] = self.creds_file
        if self.tls_ca is not None:
            try:
                out["tls"] = ssl.create_default_context(cafile=self.tls_ca)
            except (OSError, ssl.SSLError) as exc:
                raise TandemError(f"--nats-tls-ca {self.tls_ca}: {exc}") from exc
        return out

    def server_config(self) -> str:
        """The nats-server `authorization` block that accepts exactly these credentials."""
        if self.user is None or self.password is None:
            return ""
        # JSON string quoting is valid NATS config quoting (token_urlsafe has no quotes).
        return f'authorization {{ user: "{self.user}", password: "{self.password}" }}\n'

    def env(self) -> dict[str, str]:
        """The environment that hands these credentials to a child service."""
        out = {}
        if self.user is not None and self.password is not None:
            out = {"TANDEM_NATS_USER": self.user, "TANDEM_NATS_PASSWORD": self.password}
        if self.creds_file is not None:
            out["TANDEM_NATS_CREDS"] = self.creds_file
        if self.tls_ca is not None:
            out["TANDEM_NATS_TLS_CA"] = self.tls_ca
        return out


@dataclass(frozen=True)
class ClusterAuth:
    """Per-run credentials for an embedded nats-server: one identity per role, each allowed
    only its subjects (shared/bus/permissions.py), and an unrestricted admin (the launcher
    itself, tests, operators' tools)."""

    admin: BusAuth
    roles: dict[str, BusAuth]

    @classmethod
    def generate(cls) -> ClusterAuth:
        return cls(BusAuth.generate("admin"), {role: BusAuth.generate(role) for role in ROLES})

    def for_role(self, role: str) -> BusAuth:
        return self.roles[role]

    def server_config(self) -> str:
        """The nats-server `authorization` block with every identity and its permissions."""
        users = [
            user_block(str(auth.user), str(auth.password), role)
            for role, auth in self.roles.items()
        ]
        users.append(user_block(str(self.admin.user), str(self.admin.password), None))
        return "authorization { users = [\n  " + ",\n  ".join(users) + "\n] }\n"
