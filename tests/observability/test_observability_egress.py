"""The egress guard: internal forms pass, everything else is refused with endpoint and rule."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.observability.egress import (
    EgressAllowlist,
    EgressRefusedError,
    check_url,
    exporter_endpoints_from_environment,
    url_host,
)
from gateway.observability.telemetry import Telemetry, check_egress
from gateway.settings import Settings

NO_ALLOWLIST = EgressAllowlist()

ALLOWED_NETWORKS = [
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
    )
]

label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")


def _url(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{port}/v1/traces"


def _in_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == n.version and address in n for n in ALLOWED_NETWORKS)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://127.0.0.1:4318", "loopback (127.0.0.0/8)"),
        ("http://localhost:4318/v1/traces", "loopback name (localhost)"),
        ("http://[::1]:4318", "loopback (::1)"),
        ("http://10.2.3.4:4318", "private (RFC 1918, 10.0.0.0/8)"),
        ("https://172.31.255.1", "private (RFC 1918, 172.16.0.0/12)"),
        ("http://192.168.1.10:4317", "private (RFC 1918, 192.168.0.0/16)"),
        ("http://[fd12:3456::1]:4318", "unique-local (fc00::/7)"),
        ("http://[fe80::1%25eth0]:4318", "link-local (fe80::/10)"),
        ("http://169.254.1.1", "link-local (169.254.0.0/16)"),
        ("http://[::ffff:10.1.1.1]", "private (RFC 1918, 10.0.0.0/8)"),
        ("http://otel-collector.monitoring.svc:4318", "cluster-internal name (*.svc)"),
        (
            "http://otel-collector.monitoring.svc.cluster.local:4318",
            "cluster-internal name (*.cluster.local)",
        ),
        ("http://tempo.observability.cluster.local", "cluster-internal name (*.cluster.local)"),
        ("otel-collector.monitoring.svc:4317", "cluster-internal name (*.svc)"),
        ("http://OTEL.Monitoring.SVC.:4318", "cluster-internal name (*.svc)"),
    ],
)
def test_internal_forms_pass_with_their_rule(url: str, rule: str) -> None:
    assert check_url(url, NO_ALLOWLIST).rule == rule


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            "https://otlp.eu01.nr-data.net:4318",
            "'otlp.eu01.nr-data.net' is a name outside the cluster",
        ),
        ("http://8.8.8.8:4318", "'8.8.8.8' is a public address"),
        ("http://[2001:4860:4860::8888]", "'2001:4860:4860::8888' is a public address"),
        ("http://100.64.0.1", "'100.64.0.1' is a public address"),
        ("http://otel-collector:4318", "'otel-collector' is a name outside the cluster"),
        ("http://10.0.0.1@collector.example.com", "'collector.example.com' is a name outside"),
        ("http://evil.example.com\\.svc", "is not a valid host name"),
        ("http://svc.evil.example.com", "'svc.evil.example.com' is a name outside the cluster"),
        ("http://2130706433", "'2130706433' is a name outside the cluster"),
        ("http://0.0.0.0:4318", "'0.0.0.0' is a public address"),
        ("http:///v1/traces", "it names no host"),
    ],
)
def test_everything_else_is_refused_naming_endpoint_and_rule(url: str, reason: str) -> None:
    with pytest.raises(EgressRefusedError) as caught:
        check_url(url, NO_ALLOWLIST, source="OTEL_EXPORTER_OTLP_ENDPOINT")
    message = str(caught.value)
    assert f"egress refused for OTEL_EXPORTER_OTLP_ENDPOINT {url!r}" in message
    assert reason in message
    assert "cluster-internal names (*.svc, *.svc.cluster.local, *.cluster.local)" in message


@given(st.ip_addresses(), st.integers(min_value=1, max_value=65535))
def test_an_address_passes_exactly_when_it_lies_in_an_internal_range(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
) -> None:
    url = _url(address, port)
    if _in_allowed(address):
        assert check_url(url, NO_ALLOWLIST).host == str(address)
    else:
        with pytest.raises(EgressRefusedError, match="is a public address"):
            check_url(url, NO_ALLOWLIST)


@given(
    st.lists(label, min_size=1, max_size=4),
    st.sampled_from([".svc", ".svc.cluster.local", ".cluster.local"]),
)
def test_any_cluster_internal_name_passes(labels: list[str], suffix: str) -> None:
    host = ".".join(labels) + suffix
    assert check_url(f"https://{host}:4318", NO_ALLOWLIST).host == host


@given(st.lists(label, min_size=1, max_size=3), st.sampled_from(["com", "net", "io", "ch", "eu"]))
def test_public_names_are_refused_and_never_resolved(labels: list[str], tld: str) -> None:
    host = ".".join([*labels, tld])
    with pytest.raises(EgressRefusedError, match="is a name outside the cluster"):
        check_url(f"https://{host}/v1/traces", NO_ALLOWLIST)


@given(st.lists(label, min_size=1, max_size=3))
def test_suffix_allowlist_admits_subdomains_only(labels: list[str]) -> None:
    allowlist = EgressAllowlist.parse(["*.corp.example"])
    host = ".".join(labels) + ".corp.example"
    assert check_url(f"https://{host}", allowlist).rule == "egress_allowlist entry '*.corp.example'"
    with pytest.raises(EgressRefusedError):
        check_url("https://corp.example", allowlist)
    with pytest.raises(EgressRefusedError):
        check_url(f"https://{host}.evil.com", allowlist)


def test_exact_host_and_cidr_allowlist_entries() -> None:
    allowlist = EgressAllowlist.parse(["Collector.Example.COM", "203.0.113.0/24", "2001:db8::/32"])
    assert check_url("https://collector.example.com:4318", allowlist).rule == (
        "egress_allowlist entry 'collector.example.com'"
    )
    assert (
        check_url("http://203.0.113.200", allowlist).rule
        == "egress_allowlist entry '203.0.113.0/24'"
    )
    assert (
        check_url("http://[2001:db8::7]", allowlist).rule
        == "egress_allowlist entry '2001:db8::/32'"
    )
    for refused in ("https://other.example.com", "http://203.0.114.1", "http://[2001:db9::1]"):
        with pytest.raises(EgressRefusedError):
            check_url(refused, allowlist)


@pytest.mark.parametrize(
    "entry", ["", "*", "*.", "10.0.0.0/33", "bad host", "*.a..b", "http://x.com"]
)
def test_malformed_allowlist_entries_are_errors(entry: str) -> None:
    with pytest.raises(ValueError, match="egress_allowlist entry"):
        EgressAllowlist.parse([entry])


def test_url_host_accepts_scheme_less_grpc_endpoints() -> None:
    assert url_host("collector.ns.svc:4317") == "collector.ns.svc"
    assert url_host("http://[fd00::1]:4318/v1/traces") == "fd00::1"


def test_exporter_endpoint_variables_are_all_collected() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a.svc:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b.svc:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c.svc:4318/v1/metrics",
        "OTEL_EXPORTER_ZIPKIN_ENDPOINT": "http://d.svc:9411",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": " ",
        "OTEL_EXPORTER_OTLP_HEADERS": "x=y",
        "HTTP_ENDPOINT": "https://public.example.com",
    }
    assert exporter_endpoints_from_environment(environ) == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a.svc:4318",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c.svc:4318/v1/metrics",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b.svc:4318/v1/traces",
        "OTEL_EXPORTER_ZIPKIN_ENDPOINT": "http://d.svc:9411",
    }


def test_startup_refuses_a_public_endpoint_from_settings_or_environment() -> None:
    with pytest.raises(
        EgressRefusedError,
        match=re.escape("egress refused for otlp_endpoint 'https://api.honeycomb.io'"),
    ):
        Telemetry.start(Settings(otlp_endpoint="https://api.honeycomb.io"), environ={})
    with pytest.raises(EgressRefusedError, match="for OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        Telemetry.start(
            Settings(),
            environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://otlp.datadoghq.eu"},
        )


def test_startup_accepts_internal_and_allowlisted_endpoints() -> None:
    settings = Settings(
        otlp_endpoint="http://otel.monitoring.svc:4318", egress_allowlist=["*.corp.example"]
    )
    allowed = check_egress(
        settings,
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://tempo.corp.example/v1/traces"},
    )
    assert [(a.source, a.rule) for a in allowed] == [
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "egress_allowlist entry '*.corp.example'"),
        ("otlp_endpoint", "cluster-internal name (*.svc)"),
    ]
