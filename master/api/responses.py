"""Response bodies of the routes simple enough to declare (``Route.response``); they feed the OpenAPI
document only: handlers still build their JSON, and the schemathesis test holds the two equal.

Every other route documents its success body as "an object".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Liveness(BaseModel):
    status: str = Field(description="Always ok.")
    version: str
    instance: str = Field(description="This master process.")


class Readiness(Liveness):
    status: str = Field(description="ok, or degraded when a check failed (then the status is 503).")
    checks: dict[str, str] = Field(description="database and bus: ok, or error: <what failed>.")


class EnrollmentToken(BaseModel):
    token: str = Field(description="One-time token; it enrolls one host.")
    expires_at: str
    enroll_command: str = Field(description="Installs, enrolls and starts the agent (the installer served by this master).")
    enroll_command_manual: str = Field(description="Enrolls an agent installed by other means.")


class Enrollment(BaseModel):
    host_id: str
    certificate: str = Field(description="PEM host certificate.")
    ca_certificate: str = Field(description="PEM certificate of the platform CA.")
    relay_urls: list[str]
    not_after: str


class EnrollmentCheck(BaseModel):
    usable: bool = Field(description="Always true: a token that cannot enroll a host is 403 with the reason's code, as POST /enroll answers it.")
    expires_at: str = Field(description="Until when the token can enroll a host (if no other host uses it first).")


class CommandAccepted(BaseModel):
    command_id: str
    host_id: str


class SessionAccount(BaseModel):
    id: str
    name: str
    role: str
    email_verified: bool = Field(description="False for a self-service account whose address is not verified yet: it cannot rent or enrol hosts.")


class ConsoleSession(BaseModel):
    account: SessionAccount
    csrf_token: str = Field(description="Send it in X-CSRF-Token with every change.")
    expires_at: str


class SignedOut(BaseModel):
    signed_out: bool


class TemplateView(BaseModel):
    name: str
    description: str
    image: str = Field(description="The image the template runs.")
    command: list[str] | None = Field(description="Replaces the image's ENTRYPOINT; null: the image's own.")
    args: list[str] | None = Field(description="Replaces the image's CMD; null: the image's own.")
    env: dict[str, str]
    ports: list[int] = Field(description="TCP ports the workload serves.")
    shm_mib: int | None = Field(description="Size of /dev/shm, MiB; null: the agent's default.")
    workload: dict[str, Any] = Field(description="The whole container workload a rental of this template runs.")
    updated_at: str


class TemplateList(BaseModel):
    templates: list[TemplateView]


class TemplateDeleted(BaseModel):
    name: str
    deleted: bool


class SshKeyView(BaseModel):
    id: str
    name: str
    algorithm: str = Field(description="The key type: ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa.")
    fingerprint: str = Field(description="SHA256 fingerprint as ssh-keygen -lf prints it (SHA256:..., unpadded base64).")
    public_key: str = Field(description="The key in canonical OpenSSH form: 'type base64', without the comment.")
    created_at: str
    last_used_at: str | None = Field(description="When the key last opened an SSH session; null: never.")


class SshKeyList(BaseModel):
    ssh_keys: list[SshKeyView]


class SshKeyDeleted(BaseModel):
    id: str
    deleted: bool


class SshEndpoint(BaseModel):
    host_key: str = Field(description="The rental's SSH host key (OpenSSH form): pin it, e.g. in known_hosts under host_alias.")
    host_alias: str = Field(description="The name to file the host key under (ssh -o HostKeyAlias=...).")
    user: str


class ConnectView(BaseModel):
    rental_id: str
    kind: Literal["ssh", "tcp"]
    port: int
    relay_id: str
    relay_url: str = Field(description="wss:// URL: open a websocket with 'Authorization: Bearer <token>' (or ?token=); "
                           "binary messages carry the stream's bytes both ways.")
    token: str = Field(description="Opens connections until expires_at; connections outlive it.")
    expires_at: str
    ca_pem: str = Field(description="The CA the relay's TLS certificate chains to.")
    ssh: SshEndpoint | None = None
    web_url: str | None = Field(None, description="For a TCP port: an https:// address of the port for a browser (the relay's "
                                "web ports), the token in its query; it sets a cookie and redirects.")


class MailSent(BaseModel):
    status: str = Field(description="What was mailed; the same answer whether the address has an account or not.")


class EmailVerified(BaseModel):
    email: str
    verified: bool


class PasswordReset(BaseModel):
    reset: bool
    sessions_ended: int = Field(description="Console sessions the new password ended (every one of the account's).")


class SignedOutEverywhere(BaseModel):
    sessions_ended: int


class PasskeyView(BaseModel):
    id: str
    name: str
    created_at: str
    last_used_at: str | None = Field(description="When it last signed in; null: never.")
    transports: list[str] = Field(description="How the browser said it reaches the authenticator (internal, usb, hybrid, …).")


class PasskeyList(BaseModel):
    passkeys: list[PasskeyView]


class PasskeyDeleted(BaseModel):
    id: str
    deleted: bool
