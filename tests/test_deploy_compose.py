"""compose.yaml and .env.example, checked without a Docker engine: the Compose specification's
schema, and what matters to Jobplane (commands, settings, start-up order, grace, probes)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from jobplane.app import load_app
from jobplane_api.main import create_app
from jobplane_api.settings import ApiSettings
from jobplane_worker.settings import WorkerSettings
from tests.cli_helpers import ROOT
from tests.deploy_helpers import (
    IMAGE_APPS,
    parse_command,
    routes,
    seconds,
    unknown_env_names,
)

#: The Compose Specification's JSON schema (see tests/schemas/compose-spec/README.md).
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec" / "compose-spec.json"
ROLES = ("migrate", "api", "scheduler", "worker")
OWN_JOBS = ROOT / "examples" / "own_jobs"
OVERRIDES = [OWN_JOBS / "compose.acme.yaml", OWN_JOBS / "compose.image.yaml"]


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())  # resolves `<<` merge keys
    return document


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(ROOT / "compose.yaml")


@pytest.mark.parametrize("path", [ROOT / "compose.yaml", *OVERRIDES], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_specification(path: Path) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft201909Validator(schema).validate(load(path))


def test_every_role_runs_a_real_jobplane_command(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(ROLES) <= set(services)
    for role in ROLES:
        name, params = parse_command(services[role]["command"])
        assert name == role
        if role == "worker":
            assert params["app"] in IMAGE_APPS
            load_app(params["app"])  # it really is an App
    for path in OVERRIDES:
        for service in load(path)["services"].values():
            if "command" in service:
                parse_command(service["command"])


def test_an_override_with_its_own_worker_image_sets_the_command_too() -> None:
    """Compose merges an override key by key: a worker image of one's own without a
    ``command:`` would still run compose.yaml's worker command, not the image's CMD. The
    example's override runs what its Dockerfile's CMD runs, and builds from its own context."""
    for path in OVERRIDES:
        worker = load(path)["services"]["worker"]
        if "image" in worker:
            assert "command" in worker, path.name
            assert worker["build"]["context"] != ".", path.name
    worker = load(OWN_JOBS / "compose.image.yaml")["services"]["worker"]
    cmd = [ln for ln in (OWN_JOBS / "Dockerfile").read_text().splitlines() if ln.startswith("CMD")]
    assert worker["command"] == json.loads(cmd[-1].removeprefix("CMD").strip())
    assert (ROOT / worker["build"]["context"]).resolve() == OWN_JOBS


def test_the_own_jobs_kustomize_patch_changes_the_worker_alone() -> None:
    """The README's patch names the worker Deployment and its container as k8s/base has
    them, and an image other than ``jobplane`` (which an ``images:`` entry would retag)."""
    readme = (OWN_JOBS / "README.md").read_text()
    [block] = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    patch = yaml.safe_load(block)
    base = yaml.safe_load((ROOT / "k8s" / "base" / "worker.yaml").read_text())
    assert (patch["kind"], patch["metadata"]["name"]) == (base["kind"], base["metadata"]["name"])
    [container] = patch["spec"]["template"]["spec"]["containers"]
    [base_container] = base["spec"]["template"]["spec"]["containers"]
    assert container["name"] == base_container["name"]
    assert container["image"].rsplit("/", 1)[-1].split(":")[0] != base_container["image"]
    name, params = parse_command(container["args"])
    assert name == "worker" and params["app"] == "acme_jobs.jobs:app"


def test_migrate_runs_once_before_every_role(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for role in ("api", "scheduler", "worker"):
        depends = services[role]["depends_on"]
        assert depends["migrate"] == {"condition": "service_completed_successfully"}
        assert depends["postgres"]["condition"] == depends["redis"]["condition"]
        assert depends["redis"]["condition"] == "service_healthy"


def test_replicas_storage_and_backend_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["scheduler"]["deploy"]["replicas"] == 2
    assert services["worker"]["deploy"]["replicas"] >= 1
    assert "container_name" not in services["worker"]  # --scale needs generated names
    for backend in ("postgres", "redis"):
        assert services[backend]["healthcheck"]["test"]
        [volume] = services[backend]["volumes"]
        assert volume.split(":")[0] in compose["volumes"]


def test_probes_point_at_routes_the_roles_serve(compose: dict[str, Any]) -> None:
    services = compose["services"]
    _, api = parse_command(services["api"]["command"])
    assert services["api"]["ports"] == ["${API_PORT:-8000}:" + str(api["port"])]
    for role in ("api", "scheduler", "worker"):
        url = services[role]["environment"]["HEALTHCHECK_URL"]
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\w+)", url)
        assert match, url
        _, params = parse_command(services[role]["command"])
        port = params["port"] if role == "api" else params["health_port"]
        assert int(match[1]) == port and match[2] in routes(role), (role, url)
    assert services["migrate"]["environment"]["HEALTHCHECK_URL"] == ""


def test_the_worker_stop_grace_outlasts_its_own_grace(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    grace = re.fullmatch(
        r"\$\{JOBPLANE_GRACE_S:-(\d+)\}", worker["environment"]["JOBPLANE_GRACE_S"]
    )
    assert grace, "the worker's grace comes from .env with a default"
    defaults = WorkerSettings()
    # SIGTERM → grace for running jobs → cancellation signalled, timeout grace → release.
    needed = float(grace[1]) + defaults.timeout_grace_s
    assert seconds(worker["stop_grace_period"]) >= needed + 5
    for role in ("api", "scheduler"):
        assert seconds(compose["services"][role]["stop_grace_period"]) >= 10


def test_every_setting_named_exists_and_env_example_covers_the_file(
    compose: dict[str, Any],
) -> None:
    text = (ROOT / "compose.yaml").read_text()
    interpolated = set(re.findall(r"\$\{(\w+)", text))
    example = {
        ln.split("=", 1)[0]
        for ln in (ROOT / ".env.example").read_text().splitlines()
        if ln and not ln.startswith("#")
    }
    assert interpolated <= example, interpolated - example
    assert "\nJOBPLANE_LOG_FORMAT=json\n" in (ROOT / ".env.example").read_text()
    names = [n for s in compose["services"].values() for n in s.get("environment", {})]
    assert unknown_env_names([*names, *example, *interpolated]) == []


def test_every_jobplane_service_reads_the_env_file(compose: dict[str, Any]) -> None:
    for role in ROLES:
        assert compose["services"][role]["env_file"] == ".env"
        assert compose["services"][role]["init"] is True
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_dockerfiles_pass_the_linter() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev lock installs it on Linux x86-64)")
    dockerfiles = [ROOT / "Dockerfile", ROOT / "examples" / "own_jobs" / "Dockerfile"]
    result = subprocess.run(
        [hadolint, "--no-color", *map(str, dockerfiles)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_quick_start_matches_the_files(compose: dict[str, Any]) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deploy with compose") : readme.index("## A job, end to end")]
    example = (ROOT / ".env.example").read_text()
    for name in re.findall(r"s/\^(\w+)=", section):  # the secrets the sed lines fill in
        assert f"\n{name}=\n" in example, name
    for service in re.findall(r"--scale (\w+)=|logs -f (\w+)", section):
        assert "".join(service) in compose["services"]
    [path] = re.findall(r"-X POST http://127\.0\.0\.1:8000(/\S+)", section)
    job = path.split("/")[4]
    assert path.replace(f"/{job}/", "/{key}/") in routes_with("post")
    _, params = parse_command(compose["services"]["worker"]["command"])
    assert job in load_app(params["app"]).jobs
    for link in re.findall(r"\]\(([^)#]+)\)", section):
        assert (ROOT / link).exists(), link
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    for link in re.findall(r"\]\((\.\./[^)#]+)\)", deploy):
        assert (ROOT / "docs" / link).resolve().exists(), link


def routes_with(method: str) -> set[str]:
    paths = create_app(ApiSettings()).openapi()["paths"]
    return {path for path, operations in paths.items() if method in operations}
