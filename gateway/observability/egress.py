"""The egress guard: every outbound URL the gateway is given must point inside the network.

A host passes when it is loopback, a private (RFC 1918), unique-local (fc00::/7) or
link-local address, a cluster-internal name, or matches an operator allowlist entry.
Names are judged as written and never resolved: resolving would itself be a DNS query
leaving the host, and a public name that resolves to a private address today may not
tomorrow. A public name the operator trusts belongs on the allowlist.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_ADDRESS_RULES: tuple[tuple[str, IPNetwork], ...] = (
    ("loopback (127.0.0.0/8)", ipaddress.ip_network("127.0.0.0/8")),
    ("loopback (::1)", ipaddress.ip_network("::1/128")),
    ("private (RFC 1918, 10.0.0.0/8)", ipaddress.ip_network("10.0.0.0/8")),
    ("private (RFC 1918, 172.16.0.0/12)", ipaddress.ip_network("172.16.0.0/12")),
    ("private (RFC 1918, 192.168.0.0/16)", ipaddress.ip_network("192.168.0.0/16")),
    ("unique-local (fc00::/7)", ipaddress.ip_network("fc00::/7")),
    ("link-local (169.254.0.0/16)", ipaddress.ip_network("169.254.0.0/16")),
    ("link-local (fe80::/10)", ipaddress.ip_network("fe80::/10")),
)

_NAME_RULES: tuple[tuple[str, str], ...] = (
    ("loopback name (localhost)", "localhost"),
    ("cluster-internal name (*.svc)", ".svc"),
    ("cluster-internal name (*.cluster.local)", ".cluster.local"),
)

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_HOST_PATTERN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")

ALLOWED_FORMS = (
    "loopback, private (RFC 1918), unique-local (fc00::/7) or link-local addresses, "
    "localhost, cluster-internal names (*.svc, *.svc.cluster.local, *.cluster.local), "
    "or an entry of egress_allowlist"
)

# The environment variables through which OpenTelemetry exporters are pointed somewhere.
_EXPORTER_ENDPOINT_VARIABLE = re.compile(r"^OTEL_EXPORTER_[A-Z0-9_]*ENDPOINT$")


class EgressRefusedError(ValueError):
    """An outbound URL points outside the network; names the endpoint and the rule."""

    def __init__(self, source: str, url: str, reason: str) -> None:
        super().__init__(
            f"egress refused for {source} {url!r}: {reason}. Allowed are {ALLOWED_FORMS}."
        )
        self.source = source
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class EgressAllowed:
    """Why an outbound URL passed the guard."""

    source: str
    url: str
    host: str
    rule: str


@dataclass(frozen=True)
class EgressAllowlist:
    """The operator's exceptions: exact hosts, ``*.suffix`` patterns and CIDR ranges."""

    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> EgressAllowlist:
        """Read allowlist entries; a malformed entry is an error rather than silently ignored."""
        hosts: set[str] = set()
        suffixes: list[str] = []
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower().rstrip(".")
            if "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(
                        f"egress_allowlist entry {raw!r} is not a valid CIDR"
                    ) from None
            elif entry.startswith("*."):
                suffix = entry[1:]
                if not _HOST_PATTERN.match(suffix[1:]):
                    raise ValueError(
                        f"egress_allowlist entry {raw!r} is not a valid *.suffix pattern"
                    )
                suffixes.append(suffix)
            elif (address := _ip_literal(entry)) is not None:
                hosts.add(str(address))
            elif _HOST_PATTERN.match(entry):
                hosts.add(entry)
            else:
                raise ValueError(
                    f"egress_allowlist entry {raw!r} is not a host, *.suffix pattern or CIDR"
                )
        return cls(frozenset(hosts), tuple(suffixes), tuple(networks))

    def match(self, host: str, address: IPAddress | None) -> str | None:
        """The allowlist entry that admits ``host``, written as the operator would recognise it."""
        if host in self.hosts:
            return f"egress_allowlist entry {host!r}"
        for suffix in self.suffixes:
            if host.endswith(suffix):
                return f"egress_allowlist entry '*{suffix}'"
        if address is not None:
            for network in self.networks:
                if address.version == network.version and address in network:
                    return f"egress_allowlist entry '{network}'"
        return None


def url_host(url: str) -> str:
    """The host of ``url``, lower-cased, without brackets or a trailing dot.

    Accepts ``host:port`` without a scheme, as gRPC endpoints are often written.
    """
    text = url.strip()
    parsed = urlsplit(text if "://" in text else f"//{text}")
    return (parsed.hostname or "").rstrip(".")


def check_url(url: str, allowlist: EgressAllowlist, *, source: str = "endpoint") -> EgressAllowed:
    """Allow ``url`` or raise :class:`EgressRefusedError` naming it and the rule it failed."""
    host = url_host(url)
    if not host:
        raise EgressRefusedError(source, url, "it names no host")
    address = _ip_literal(host)
    if address is not None:
        host = str(address)
        rule = _address_rule(address)
    elif _HOST_PATTERN.match(host):
        rule = _name_rule(host)
    else:
        raise EgressRefusedError(source, url, f"host {host!r} is not a valid host name")
    rule = rule or allowlist.match(host, address)
    if rule is None:
        kind = "a public address" if address is not None else "a name outside the cluster"
        raise EgressRefusedError(
            source, url, f"host {host!r} is {kind} and matches no egress_allowlist entry"
        )
    return EgressAllowed(source=source, url=url, host=host, rule=rule)


def check_urls(urls: Mapping[str, str], allowlist: EgressAllowlist) -> list[EgressAllowed]:
    """Check every ``source -> url``; the first refusal stops everything."""
    return [check_url(url, allowlist, source=source) for source, url in urls.items()]


def exporter_endpoints_from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``OTEL_EXPORTER_*ENDPOINT`` variables that are set, which exporters would follow."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if _EXPORTER_ENDPOINT_VARIABLE.match(name) and value.strip()
    }


def _address_rule(address: IPAddress) -> str | None:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for rule, network in _ADDRESS_RULES:
        if address.version == network.version and address in network:
            return rule
    return None


def _name_rule(host: str) -> str | None:
    for rule, pattern in _NAME_RULES:
        if pattern.startswith("."):
            if host.endswith(pattern):
                return rule
        elif host == pattern or host.endswith(f".{pattern}"):
            return rule
    return None


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
