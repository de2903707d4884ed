"""k8s/, checked without a cluster: every overlay rendered by ``kubectl kustomize``, every
object validated against the Kubernetes schemas of a pinned version, and what matters to
Jobplane (commands, probes, grace, settings, security, scaling on the real stream names)."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from jobplane.bus.keys import GROUP, Keys
from jobplane_worker.settings import WorkerSettings
from tests.cli_helpers import ROOT
from tests.deploy_helpers import IMAGE_APPS, parse_command, routes, unknown_env_names

#: The Kubernetes version whose schemas the manifests must satisfy (strictly: no unknown
#: field). The oldest one still supported by the major managed services.
K8S_VERSION = "1.30.0"
OVERLAYS = ("dev", "prod")
ROLES = ("api", "scheduler", "worker")
#: Custom resources of KEDA: no schema of theirs ships with kubernetes-validate, so they are
#: skipped here by name, and checked by hand below (stream names, target, credentials).
KEDA_OBJECTS = {("ScaledObject", "jobplane-worker"), ("TriggerAuthentication", "jobplane-redis")}

Doc = dict[str, Any]


@cache
def rendered(overlay: str) -> tuple[Doc, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            raise AssertionError("kubectl is missing: scripts/k8s-tools.sh installs it")
        pytest.skip("kubectl is not installed (scripts/k8s-tools.sh installs it)")
    result = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def find(overlay: str, kind: str, name: str | None = None) -> list[Doc]:
    return [
        d
        for d in rendered(overlay)
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(overlay: str, kind: str, name: str) -> Doc:
    [doc] = find(overlay, kind, name)
    return doc


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def workloads(overlay: str) -> list[Doc]:
    return [d for d in rendered(overlay) if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def jobplane_containers(overlay: str) -> list[tuple[Doc, Doc]]:
    """(workload, container) of every container running the Jobplane image."""
    return [
        (w, c)
        for w in workloads(overlay)
        for c in pod_spec(w)["containers"]
        if c["image"].split("/")[-1].startswith("jobplane")
    ]


def secret_templates() -> dict[str, Doc]:
    """The Secrets of k8s/base/secret.example.yaml, by name."""
    text = (ROOT / "k8s" / "base" / "secret.example.yaml").read_text()
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(text)}


def config(overlay: str) -> dict[str, str]:
    data: dict[str, str] = one(overlay, "ConfigMap", "jobplane-config")["data"]
    return data


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_pinned_kubernetes_schemas(overlay: str) -> None:
    skipped = set()
    for doc in rendered(overlay):
        identity = (doc["kind"], doc["metadata"]["name"])
        if identity in KEDA_OBJECTS:
            assert doc["apiVersion"] == "keda.sh/v1alpha1"
            skipped.add(identity)
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "jobplane"
    assert skipped == (KEDA_OBJECTS if overlay == "prod" else set())


def test_the_secret_template_validates_and_the_validator_is_strict() -> None:
    templates = secret_templates()
    assert set(templates) == {"jobplane-secrets", "jobplane-bootstrap"}
    for template in templates.values():
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    deployment = dict(one("prod", "Deployment", "jobplane-api"))
    deployment["spec"] = {**deployment["spec"], "replicaz": 2}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_real_jobplane_command(overlay: str) -> None:
    seen = set()
    for workload, container in jobplane_containers(overlay):
        role, params = parse_command(container["args"])
        assert role == workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert "command" not in container  # the image's entrypoint: jobplane
        if role == "worker":
            assert params["app"] in IMAGE_APPS
        seen.add(role)
    assert seen == {"migrate", *ROLES}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_point_at_routes_each_role_serves(overlay: str) -> None:
    for _, container in jobplane_containers(overlay):
        role, params = parse_command(container["args"])
        if role == "migrate":
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        serving = params["port"] if role == "api" else params["health_port"]
        kinds = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]["httpGet"]
            assert ports[probe["port"]] == serving, (role, kind)
            assert probe["path"] in routes(role), (role, kind, probe["path"])
            kinds[kind] = probe["path"]
        assert kinds == {
            "startupProbe": "/healthz",
            "livenessProbe": "/healthz",
            "readinessProbe": "/readyz",
        }
        # The startup probe outlasts the wait for Postgres, Redis and the migration.
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget > float(config(overlay)["JOBPLANE_STARTUP_TIMEOUT_S"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_outlasts_its_grace_and_takes_its_id_from_the_pod(overlay: str) -> None:
    worker = one(overlay, "Deployment", "jobplane-worker")
    settings = config(overlay)
    grace = float(settings["JOBPLANE_GRACE_S"]) + float(settings["JOBPLANE_TIMEOUT_GRACE_S"])
    assert pod_spec(worker)["terminationGracePeriodSeconds"] >= grace + 10
    [container] = pod_spec(worker)["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["JOBPLANE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for role in ("api", "scheduler"):
        spec = pod_spec(one(overlay, "Deployment", f"jobplane-{role}"))
        assert spec["terminationGracePeriodSeconds"] >= 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_role_is_pid_1_and_the_api_outlasts_its_endpoints(overlay: str) -> None:
    """As PID 1 a role ignored a SIGTERM that came before its handler (a pod deleted while it
    started waited out its grace) and reaped no orphan; the api closed its port while the
    Service still sent it requests; the autoscaled workers' fixed count, put back by every
    apply, scaled a busy fleet down."""
    for role in ROLES:
        assert pod_spec(one(overlay, "Deployment", f"jobplane-{role}"))["shareProcessNamespace"]
    api = pod_spec(one(overlay, "Deployment", "jobplane-api"))
    [container] = api["containers"]
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep" and api["terminationGracePeriodSeconds"] >= float(pause[1]) + 30
    assert "replicas" not in one(overlay, "Deployment", "jobplane-worker")["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migrate_is_a_job_the_roles_wait_for(overlay: str) -> None:
    """The migration runs as a Job beside the rollout; every role waits for the schema
    (``SchemaBehindError`` is retried for JOBPLANE_STARTUP_TIMEOUT_S), none migrates."""
    job = one(overlay, "Job", "jobplane-migrate")
    [container] = pod_spec(job)["containers"]
    assert container["args"] == ["migrate"]
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    assert float(config(overlay)["JOBPLANE_STARTUP_TIMEOUT_S"]) >= 30
    for workload, container in jobplane_containers(overlay):
        if workload["kind"] == "Deployment":
            assert "migrate" not in container["args"]
            assert not pod_spec(workload).get("initContainers")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_named_exists(overlay: str) -> None:
    names = list(config(overlay))
    for workload, container in jobplane_containers(overlay):
        names += [e["name"] for e in container.get("env", [])]
        refs = [s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s]
        # The bootstrap admin token reaches the migrate Job alone: a role's jobs run any code.
        migrate = workload["kind"] == "Job"
        assert (
            refs == ["jobplane-secrets", "jobplane-bootstrap"] if migrate else ["jobplane-secrets"]
        )
    secrets = find(overlay, "Secret", "jobplane-secrets")
    template = secret_templates()["jobplane-secrets"]
    for secret in [*secrets, template]:
        names += list(secret["stringData"])
        assert {"JOBPLANE_DATABASE_URL", "JOBPLANE_REDIS_URL"} <= set(secret["stringData"])
        assert "JOBPLANE_BOOTSTRAP_ADMIN_TOKEN" not in secret["stringData"]
    for bootstrap in [
        *find(overlay, "Secret", "jobplane-bootstrap"),
        secret_templates()["jobplane-bootstrap"],
    ]:
        assert list(bootstrap["stringData"]) == ["JOBPLANE_BOOTSTRAP_ADMIN_TOKEN"]
    assert unknown_env_names(names) == []
    assert config(overlay)["JOBPLANE_LOG_FORMAT"] == "json"
    assert len(secrets) == (1 if overlay == "dev" else 0)  # prod: created by the operator


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_locked_down_and_sized(overlay: str) -> None:
    for workload in workloads(overlay):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            assert set(container["resources"]) == {"requests", "limits"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_budgets_and_services_select_the_pods(overlay: str) -> None:
    def labels(workload: Doc) -> dict[str, str]:
        selected: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
        return selected

    def selects(selector: dict[str, str], workload: Doc) -> bool:
        return selector.items() <= labels(workload).items()

    deployments = {d["metadata"]["name"]: d for d in find(overlay, "Deployment")}
    assert deployments["jobplane-api"]["spec"]["replicas"] >= 2
    assert deployments["jobplane-scheduler"]["spec"]["replicas"] == 2
    for role in ROLES:
        workload = deployments[f"jobplane-{role}"]
        assert selects(workload["spec"]["selector"]["matchLabels"], workload)
        [budget] = [
            b
            for b in find(overlay, "PodDisruptionBudget")
            if selects(b["spec"]["selector"]["matchLabels"], workload)
        ]
        assert budget["metadata"]["name"] == f"jobplane-{role}"
    service = one(overlay, "Service", "jobplane-api")
    assert selects(service["spec"]["selector"], deployments["jobplane-api"])
    [container] = pod_spec(deployments["jobplane-api"])["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_the_roles_reach_what_they_need(overlay: str) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in find(overlay, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    api_ports = [
        p["port"] for rule in policies["jobplane-api-ingress"]["ingress"] for p in rule["ports"]
    ]
    assert api_ports == [8000]
    egress = {p["port"] for rule in policies["jobplane-egress"]["egress"] for p in rule["ports"]}
    assert {53, 5432, 6379} <= egress
    if overlay == "dev":
        assert {"postgres-ingress", "redis-ingress"} <= set(policies)


def test_the_commented_collector_rule_opens_the_endpoint_the_config_suggests() -> None:
    """Uncommented as configmap.yaml and network-policies.yaml say, the egress rule is valid
    and lets the roles reach the suggested collector (its namespace and port): the egress is
    closed otherwise, and spans would be dropped without a word."""
    base = ROOT / "k8s" / "base"
    [endpoint] = [
        ln.split(":", 1)[1].strip()
        for ln in (base / "configmap.yaml").read_text().splitlines()
        if ln.strip().startswith("# OTEL_EXPORTER_OTLP_ENDPOINT:")
    ]
    host_port = endpoint.split("://", 1)[1]
    host, port = host_port.rsplit(":", 1)
    text = (base / "network-policies.yaml").read_text()
    start = text.index("    # - to:")
    uncommented = text[:start] + "".join(
        ln.replace("    # ", "    ", 1) + "\n" for ln in text[start:].splitlines()
    )
    [policy] = [
        d for d in yaml.safe_load_all(uncommented) if d["metadata"]["name"] == "jobplane-egress"
    ]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    rule = policy["spec"]["egress"][-1]
    [peer] = rule["to"]
    namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert host.split(".")[1] == namespace
    assert [p["port"] for p in rule["ports"]] == [int(port)]


def test_the_prod_steps_make_the_namespace_before_the_secret() -> None:
    """On a fresh cluster the Secret (created by hand, before the overlay) needs its
    namespace: docs/deploy.md creates the one the template names, then the Secret, then the
    overlay."""
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    steps = deploy[deploy.index("**prod**") :].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [ln.split("#")[0].split() for ln in steps.splitlines()]
    namespace_file = ROOT / "k8s" / "base" / "namespace.yaml"
    assert commands[0] == ["kubectl", "apply", "-f", str(namespace_file.relative_to(ROOT))]
    namespace = yaml.safe_load(namespace_file.read_text())
    for template in secret_templates().values():
        assert template["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert commands[1][:3] == ["kubectl", "apply", "-f"]
    assert commands[-1] == ["kubectl", "apply", "-k", "k8s/overlays/prod"]


def test_keda_scales_workers_on_the_streams_jobplane_really_uses() -> None:
    scaled = one("prod", "ScaledObject", "jobplane-worker")
    worker = one("prod", "Deployment", "jobplane-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    [container] = pod_spec(worker)["containers"]
    _, params = parse_command(container["args"])
    queues = params["queues"].split(",") if params["queues"] else WorkerSettings().queues
    keys = Keys(config("prod")["JOBPLANE_KEY_PREFIX"])
    expected = [stream for queue in queues for stream in keys.queue_streams(queue)]
    triggers = scaled["spec"]["triggers"]
    assert [t["metadata"]["stream"] for t in triggers] == expected
    for trigger in triggers:
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["consumerGroup"] == GROUP
        assert int(trigger["metadata"]["lagCount"]) > 0
        assert trigger["authenticationRef"]["name"] == "jobplane-redis"
    auth = one("prod", "TriggerAuthentication", "jobplane-redis")
    template = secret_templates()["jobplane-secrets"]
    dev_secret = one("dev", "Secret", "jobplane-secrets")
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == "jobplane-secrets"
        assert ref["key"] in template["stringData"] and ref["key"] in dev_secret["stringData"]
    assert not find("prod", "HorizontalPodAutoscaler")  # KEDA makes its own


def test_the_cpu_autoscaler_targets_the_workers() -> None:
    [hpa] = find("dev", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "jobplane-worker",
    }
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert not find("dev", "ScaledObject")
