"""Who may speak on the cluster's sockets, and what listens where.

Cluster sockets (the manager's, each instance's request socket, each proxy's token socket) use ZeroMQ
CURVE when ``security.keys_dir`` is set: traffic is encrypted, and a ZAP handler in every daemon admits
only the public keys in ``keys_dir/public``, each with the role its file name starts with (``instance``,
``proxy``, ``operator``, ``reader``; ``manager`` is the manager's own). Each server socket admits only the
roles that have business there, and the manager checks each message's verb against its sender's role.
Without keys, a daemon listens only on loopback unless ``security.trusted_network`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from daemons.runtime import StartupError
from daemons.throttle import Throttle


def host_of(address: str) -> str:
    """The host part of a ZeroMQ address (``tcp://H:P``), a ``host:port`` pair or a bare host."""
    if address.startswith(("ipc://", "inproc://")):
        return "localhost"
    rest = address.split("://", 1)[-1]
    try:  # a bare address, IPv6 included (::1)
        return str(ipaddress.ip_address(rest))
    except ValueError:
        pass
    if rest.startswith("["):  # [::1]:7100
        return rest[1:rest.find("]")]
    host, sep, port = rest.rpartition(":")
    return host if sep and (port.isdigit() or port == "*") else rest


def is_loopback(address: str) -> bool:
    """True when ``address`` (a ZeroMQ address, host:port or host) can only be reached from this machine."""
    host = host_of(address)
    if host in ("localhost", ""):
        return host == "localhost"
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a host name or an interface name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def read_token(path: str) -> str:
    """The bearer token in ``path`` (its first line, stripped); empty path = no token. Raises ValueError."""
    if not path:
        return ""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"the token file {path} is empty")
    return text.splitlines()[0].strip()


def metrics_token(cfg) -> str:
    """The token /metrics requires (``security.metrics_token_file``); a bad file stops the daemon."""
    try:
        return read_token(cfg.security.metrics_token_file)
    except ValueError as exc:
        raise StartupError(f"security.metrics_token_file: {exc}") from None


# ---------------------------------------------------------------------------------------------- CURVE keys

ROLES = ("manager", "instance", "proxy", "operator", "reader")
SERVER_ROLES = ("manager", "instance", "proxy")  # roles whose key also serves their daemons' sockets
# Which roles may connect to each kind of server socket (its ZAP domain).
DOMAINS = {
    "manager": frozenset({"instance", "proxy", "operator", "reader"}),
    # submits (proxies, benchmarks), migration peers; the manager's connection only carries keepalives
    "instance": frozenset({"proxy", "instance", "operator", "manager"}),
    "proxy": frozenset({"instance"}),  # token outputs
}


def role_of_name(name: str) -> str:
    """A key's role is its name up to the first '-': operator-alice is an operator."""
    return name.split("-", 1)[0]


def generate(keys_dir: Path, names: list[str], force: bool = False) -> list[str]:
    """Create a key pair per name: ``public/NAME.key`` (give to every host) and ``secret/NAME.key_secret``
    (only to the hosts or people that act as NAME). Returns the names written; raises FileExistsError
    for a name that exists unless ``force``."""
    import zmq.auth

    for name in names:
        if role_of_name(name) not in ROLES:
            raise ValueError(f"key name {name!r} must start with a role ({', '.join(ROLES)}), e.g. operator-alice")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"key name {name!r}: letters, digits, '-' and '_' only")
    public, secret = keys_dir / "public", keys_dir / "secret"
    existing = [n for n in names if (public / f"{n}.key").exists() or (secret / f"{n}.key_secret").exists()]
    if existing and not force:
        raise FileExistsError(", ".join(existing))
    public.mkdir(parents=True, exist_ok=True)
    secret.mkdir(parents=True, exist_ok=True)
    keys_dir.chmod(0o755)
    public.chmod(0o755)
    secret.chmod(0o700)
    import tempfile

    for name in names:
        with tempfile.TemporaryDirectory(dir=secret) as tmp:
            pub_file, sec_file = zmq.auth.create_certificates(tmp, name)
            Path(sec_file).chmod(0o600)
            Path(sec_file).replace(secret / f"{name}.key_secret")
            Path(pub_file).chmod(0o644)
            Path(pub_file).replace(public / f"{name}.key")
    return names


def list_keys(keys_dir: Path) -> list[dict]:
    """The keys in ``keys_dir``: name, role, whether this host holds its secret, and the public key."""
    import zmq.auth

    out = []
    for path in sorted((keys_dir / "public").glob("*.key")):
        name = path.stem
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            out.append({"name": name, "role": role_of_name(name), "secret": False, "public_key": "", "error": str(exc)})
            continue
        out.append({"name": name, "role": role_of_name(name) if role_of_name(name) in ROLES else "",
                    "secret": (keys_dir / "secret" / f"{name}.key_secret").exists(), "public_key": public.decode()})
    return out


class StartupRefused(StartupError):
    """This daemon must not start as configured; the message names the setting."""


class Security:
    """This process's side of the cluster's authentication: applied to each socket it makes.

    Without ``security.keys_dir`` it only bounds message sizes, and ``check_bind`` refuses addresses beyond
    loopback unless the network is declared trusted. With keys, server sockets are CURVE servers whose ZAP
    domain admits the roles in ``DOMAINS``, and client sockets authenticate with this process's own key
    against the server role's public key.
    """

    def __init__(self, cfg, role: str, ctx=None, log=None):
        import logging

        self.cfg = cfg
        self.role = role
        self.log = log or logging.getLogger("llumnix.security")
        self.max_message_bytes = cfg.max_message_bytes
        self.enabled = bool(cfg.keys_dir)
        self.auth = None
        self._ctx = ctx
        if not self.enabled:
            return
        self.dir = Path(cfg.keys_dir)
        if not (self.dir / "public").is_dir():
            raise StartupRefused(f"security.keys_dir = {cfg.keys_dir}: no public/ directory there "
                                 f"(make one with `llumnixctl keys generate {cfg.keys_dir}`)")
        name = cfg.key or (role if role in SERVER_ROLES else "")
        if not name:  # llumnixctl: operator if this host has its secret, else read-only
            name = "operator" if (self.dir / "secret" / "operator.key_secret").exists() else "reader"
        self.public, self.secret = self._load_secret(name, "security.key" if cfg.key else "security.keys_dir")
        self.name = name
        # Servers use their role's key, whatever key the process authenticates with as a client.
        self.server_public, self.server_secret = ((self.public, self.secret) if name == role or role not in SERVER_ROLES
                                                  else self._load_secret(role, "security.keys_dir"))
        self._servers: dict[str, bytes] = {}
        self._allowed: dict[bytes, str] = {}
        self._scanned = 0.0
        self._refused = Throttle(60.0)  # (domain, client key): a client retries every 100 ms, log once a minute
        self._scan()

    def _load_secret(self, name: str, setting: str) -> tuple[bytes, bytes]:
        import zmq.auth

        path = self.dir / "secret" / f"{name}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise StartupRefused(f"{setting}: cannot read this process's secret key {path}: {exc}") from None
        if not secret:
            raise StartupRefused(f"{setting}: {path} holds no secret key")
        return public, secret

    def _scan(self) -> None:
        """(Re)read the allowed public keys: new hosts' keys are admitted without restarting anyone."""
        import time

        import zmq.auth

        self._scanned = time.monotonic()
        allowed = {}
        for entry in list_keys(self.dir):
            if entry.get("error"):
                self.log.warning("ignoring the public key %s/public/%s.key: %s", self.dir, entry["name"], entry["error"])
            elif not entry["role"]:
                self.log.warning("ignoring the public key %s/public/%s.key: its name starts with no role (%s)",
                                 self.dir, entry["name"], ", ".join(ROLES))
            else:
                allowed[entry["public_key"].encode()] = f"{entry['role']}:{entry['name']}"
        self._allowed = allowed
        for role in SERVER_ROLES:
            path = self.dir / "public" / f"{role}.key"
            if path.exists():
                self._servers[role] = zmq.auth.load_certificate(path)[0]

    # ------------------------------------------------------------------ ZAP

    def _admit(self, domain: str, key: bytes) -> bool:
        import time

        principal = self._allowed.get(key)
        if principal is None and time.monotonic() - self._scanned > 1.0:
            self._scan()
            principal = self._allowed.get(key)
        if principal is not None and role_of_name(principal.split(":", 1)[1]) in DOMAINS.get(domain, ()):
            return True
        now = time.monotonic()
        if self._refused.due((domain, key), now):
            why = "unknown key" if principal is None else f"role {principal.split(':')[0]} may not connect here"
            self.log.warning("refused a connection to the %s socket: %s (client key %s)", domain, why, key.decode())
        return False

    def _start_auth(self) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        outer = self

        class _Auth(ThreadAuthenticator):
            def curve_user_id(self, client_public_key: bytes) -> str:
                from zmq.utils import z85

                return outer._allowed.get(z85.encode(client_public_key), "")

        class _Provider:
            @staticmethod
            def callback(domain: str, key: bytes) -> bool:
                return outer._admit(domain, key)

        ctx = zmq.Context.shadow(self._ctx.underlying) if self._ctx is not None else zmq.Context.instance()
        self.auth = _Auth(ctx)
        self.auth.start()
        for domain in DOMAINS:
            self.auth.configure_curve_callback(domain, credentials_provider=_Provider())

    # ------------------------------------------------------------------ sockets

    def server(self, sock, domain: str):
        """Make ``sock`` (bound by the caller afterwards) a server of ``domain``; returns it."""
        import zmq

        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.enabled:
            if self.auth is None:
                self._start_auth()
            sock.zap_domain = domain.encode()
            sock.curve_secretkey = self.server_secret
            sock.curve_publickey = self.server_public
            sock.curve_server = True
        return sock

    def client(self, sock, server_role: str):
        """Make ``sock`` (connected by the caller afterwards) authenticate to a ``server_role`` socket."""
        import zmq

        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.enabled:
            server = self._servers.get(server_role)
            if server is None:
                raise StartupRefused(f"security.keys_dir = {self.cfg.keys_dir}: no public/{server_role}.key "
                                     f"(the key {server_role} daemons serve with)")
            sock.curve_serverkey = server
            sock.curve_publickey = self.public
            sock.curve_secretkey = self.secret
        return sock

    @staticmethod
    def principal(frame) -> str:
        """``role:name`` of the sender of a frame received with copy=False ('' without CURVE)."""
        try:
            return frame.get("User-Id") or ""
        except Exception:  # noqa: BLE001 - pyzmq raises ZMQError or KeyError for a missing property
            return ""

    def check_bind(self, setting: str, address: str) -> None:
        """Refuse to listen beyond loopback without keys, unless the network is declared trusted."""
        if self.enabled or self.cfg.trusted_network or is_loopback(address):
            return
        raise StartupRefused(f"{setting} = {address} listens beyond loopback without authentication: set "
                             f"security.keys_dir (make keys with `llumnixctl keys generate DIR`), or "
                             f"security.trusted_network = true if nobody else can reach this network")

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
