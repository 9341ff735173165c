"""deploy/: Kubernetes manifests against Kubernetes' schemas, the compose file against the
compose spec, systemd units, and every ``onepiece`` command line in them against the CLI."""

from __future__ import annotations

import configparser
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f"{f.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


DOCS = _docs()


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifest_is_valid_for_kubernetes(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _workloads() -> list[tuple[str, dict[str, Any]]]:
    return [(n, d) for n, d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def test_every_workload_has_resources_and_the_serving_ones_have_probes() -> None:
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "DaemonSet"} <= kinds
    for name, d in _workloads():
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"], name
            if any(p.get("name") == "http" for p in c.get("ports", [])):
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
                assert c["livenessProbe"]["httpGet"]["path"] == "/livez", name


def test_the_roles_and_their_replicas() -> None:
    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    assert by["etcd"]["spec"]["replicas"] == 3
    assert by["onepiece-manager"]["spec"]["replicas"] >= 2
    assert by["onepiece-proxy"]["spec"]["replicas"] >= 2
    assert {"redis-primary", "redis-replica", "postgres", "onepiece-web", "onepiece-celery",
            "onepiece-reconciler"} <= set(by)
    node = by["onepiece-node"]
    assert node["kind"] == "DaemonSet"
    spec = node["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    (tm,) = spec["containers"]
    assert tm["resources"]["limits"]["nvidia.com/gpu"] >= 1
    # tcp by default (test_the_data_plane_defaults_to_tcp): no RDMA device is needed to schedule a node
    assert not any(k.startswith("rdma/") for k in tm["resources"]["limits"])
    assert any(m["mountPath"] == "/dev/shm" for m in tm["volumeMounts"])


def test_the_data_plane_defaults_to_tcp_and_says_how_to_switch_to_verbs() -> None:
    # verbs has not yet passed its self-test on real hardware (docs/operations.md, "RDMA hosts")
    (config,) = [d for _, d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "onepiece-config"]
    assert config["data"]["ONEPIECE_TRANSPORT"] == "tcp"
    env = (DEPLOY / "systemd" / "onepiece.env.example").read_text()
    assert "ONEPIECE_TRANSPORT=tcp" in env.splitlines()
    for text in ((DEPLOY / "k8s" / "01-config.yaml").read_text(), env):
        assert "verbs" in text and "self-test" in text and "RDMA hosts" in text


def _onepiece_commands() -> list[tuple[str, list[str]]]:
    found = []
    for name, d in _workloads():
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [None])[0] == "onepiece":
                found.append((name, c["command"][1:]))
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    for svc, body in compose["services"].items():
        cmd = body.get("command")
        if isinstance(cmd, list) and cmd[0] == "onepiece":
            found.append((f"compose:{svc}", cmd[1:]))
    for unit in (DEPLOY / "systemd").glob("*.service"):
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.read_string(unit.read_text())
        argv = shlex.split(cp["Service"]["ExecStart"])
        if argv[0].endswith("/onepiece"):
            found.append((unit.name, argv[1:]))
    return found


def test_every_onepiece_command_line_parses_with_the_cli() -> None:
    parser = build_parser()
    commands = _onepiece_commands()
    assert {c[0] for _, c in commands} >= {"node", "proxy", "manager", "etcd-auth"}
    for where, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `onepiece {' '.join(argv)}` does not parse")


def test_compose_file_validates_against_the_compose_spec() -> None:
    r = subprocess.run(
        [str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
         str(DEPLOY / "compose" / "compose.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_systemd_units_are_complete() -> None:
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {u.stem for u in units} == {"onepiece-node", "onepiece-proxy", "onepiece-manager", "onepiece-web",
                                       "onepiece-celery", "onepiece-reconciler", "onepiece-webhooks"}
    for unit in units:
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.read_string(unit.read_text())
        assert cp["Service"]["ExecStart"] and cp["Service"]["Restart"] == "always", unit.name
        # the webhook worker calls addresses clients choose: an env file of its own, without the engine's secrets
        env = "onepiece-webhooks.env" if unit.stem == "onepiece-webhooks" else "onepiece.env"
        assert cp["Service"]["EnvironmentFile"] == f"/etc/onepiece/{env}", unit.name
        example = (DEPLOY / "systemd" / f"{env}.example").read_text()
        assert "POSTGRES_PASSWORD=" in example and "DJANGO_SECRET_KEY=" in example, env
        assert ("ONEPIECE_PROXY_TOKEN=" in example) == (env == "onepiece.env"), env
        assert cp["Install"]["WantedBy"] == "multi-user.target", unit.name


def test_dockerfile_copies_what_exists() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    root = DEPLOY.parent
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (root / src).exists(), f"Dockerfile copies missing {src}"


def test_clients_get_every_etcd_member_and_nodes_their_data_address() -> None:
    """ONEPIECE_ETCD_URL lists each member of the etcd StatefulSet (a client fails over between them), each
    with the engine user's credentials (so it lives in the Secret); a TaskManager publishes its rings at its
    host's address, not the loopback default."""
    from engine.coord.client import Endpoint, parse_endpoints

    by = {d["metadata"]["name"]: d for _, d in DOCS}
    etcd = by["etcd"]["spec"]
    peers = f"{etcd['serviceName']}"
    want = [f"http://etcd-{i}.{peers}:2379" for i in range(etcd["replicas"])]
    assert "ONEPIECE_ETCD_URL" not in by["onepiece-config"]["data"]
    members = [Endpoint.parse(u) for u in parse_endpoints(by["onepiece-secrets"]["stringData"]["ONEPIECE_ETCD_URL"])]
    assert [m.url for m in members] == want
    assert {(m.username, m.password) for m in members} == {
        ("onepiece", by["onepiece-secrets"]["stringData"]["ETCD_ONEPIECE_PASSWORD"])}
    assert by[peers]["spec"]["clusterIP"] == "None"  # headless: one DNS name per member
    (tm,) = by["onepiece-node"]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(tm["command"][1:])
    assert args.data_host == "$(HOST_IP)"
    env = {e["name"]: e for e in tm["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    example = (DEPLOY / "systemd" / "onepiece.env.example").read_text()
    lines = dict(ln.split("=", 1) for ln in example.splitlines() if ln and not ln.startswith("#"))
    assert len(parse_endpoints(lines["ONEPIECE_ETCD_URL"])) == 3
    assert all(Endpoint.parse(u).username == "onepiece" for u in parse_endpoints(lines["ONEPIECE_ETCD_URL"]))
    assert lines["ONEPIECE_BIND_HOST"] not in ("127.0.0.1", "0.0.0.0")


def _admitted(app: str) -> set[str]:
    """Who the NetworkPolicies let reach pods labelled ``app``: app labels, "ipBlock", "namespace" or "any"."""
    out: set[str] = set()
    for _, d in DOCS:
        if d["kind"] != "NetworkPolicy":
            continue
        sel = d["spec"]["podSelector"].get("matchLabels", {})
        if sel and sel.get("app") != app:
            continue
        for rule in d["spec"].get("ingress", []):
            if "from" not in rule:
                out.add("any")
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    out.add(peer["podSelector"]["matchLabels"]["app"])
                elif "ipBlock" in peer:
                    out.add("ipBlock")
                else:
                    out.add("namespace")
    return out


def test_network_policies_admit_only_each_services_clients() -> None:
    """Default deny; the Proxy is reached only by the platform's processes; etcd, Redis and PostgreSQL only
    by the roles that use them; only the web platform by anyone (issue 16)."""
    pols = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    deny = pols["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    platform = {"onepiece-web", "onepiece-celery", "onepiece-reconciler"}
    assert _admitted("onepiece-proxy") == platform
    assert _admitted("postgres") == platform | {"onepiece-webhooks"}
    assert _admitted("etcd") == {"onepiece-manager", "onepiece-proxy", "onepiece-web", "onepiece-celery", "etcd",
                                 "onepiece-etcd-auth", "ipBlock"}
    assert _admitted("redis") == platform | {"onepiece-proxy", "redis", "ipBlock"}
    assert _admitted("onepiece-web") == {"any"}
    for name, d in _workloads():  # nothing else is open to all
        app = d["spec"]["template"]["metadata"]["labels"]["app"]
        if app != "onepiece-web":
            assert "any" not in _admitted(app), name


def test_the_webhook_worker_reaches_only_the_ledger_dns_and_public_addresses() -> None:
    """It calls URLs that clients chose: its egress excludes the private, link-local (cloud metadata),
    shared and loopback ranges, and the Deployment, compose service and systemd unit run it (issue 17)."""
    import ipaddress

    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    (c,) = by["onepiece-webhooks"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python", "manage.py", "deliver_webhooks"]
    (pol,) = [d for _, d in DOCS if d["kind"] == "NetworkPolicy"
              and d["spec"]["podSelector"].get("matchLabels") == {"app": "onepiece-webhooks"}]
    assert "Egress" in pol["spec"]["policyTypes"]
    blocks = [p["ipBlock"] for rule in pol["spec"]["egress"] for p in rule["to"] if "ipBlock" in p]
    for addr in ("10.1.2.3", "172.20.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "127.0.0.1",
                 "fd00::1", "fe80::1", "::1"):
        ip = ipaddress.ip_address(addr)
        assert not any(ip in ipaddress.ip_network(b["cidr"]) and not any(
            ip in ipaddress.ip_network(x) for x in b.get("except", [])) for b in blocks), addr
    assert any(ipaddress.ip_address("93.184.216.34") in ipaddress.ip_network(b["cidr"]) for b in blocks)
    # the most exposed pod holds the fewest secrets: the database's and Django's key, no Redis, etcd or Proxy ones
    assert not any("secretRef" in e for e in c["envFrom"])
    held = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "valueFrom" in e}
    assert held == {"POSTGRES_PASSWORD", "DJANGO_SECRET_KEY"}
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    assert compose["services"]["webhooks"]["command"] == ["python", "manage.py", "deliver_webhooks"]
    env = compose["services"]["webhooks"]["environment"]
    assert "POSTGRES_PASSWORD" in env and not {"ONEPIECE_REDIS_URL", "ONEPIECE_ETCD_URL", "ONEPIECE_PROXY_TOKEN"} & set(env)
    assert "deliver_webhooks" in (DEPLOY / "systemd" / "onepiece-webhooks.service").read_text()


def test_every_caller_of_the_proxy_holds_its_secret_and_nothing_binds_everywhere() -> None:
    secret = next(d for _, d in DOCS if d["kind"] == "Secret" and d["metadata"]["name"] == "onepiece-secrets")
    assert "ONEPIECE_PROXY_TOKEN" in secret["stringData"]
    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    for name in ("onepiece-proxy", "onepiece-web", "onepiece-celery", "onepiece-reconciler"):
        for c in by[name]["spec"]["template"]["spec"]["containers"]:
            assert {"name": "onepiece-secrets"} in [e.get("secretRef") for e in c["envFrom"]], name
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    assert "ONEPIECE_PROXY_TOKEN" in compose["x-onepiece-env"]
    published = {svc: body["ports"] for svc, body in compose["services"].items() if "ports" in body}
    assert published == {"web": ["127.0.0.1:8000:8000"]}
    assert compose["x-onepiece-env"]["ONEPIECE_TRUSTED_PROXY_HOPS"].endswith(":-0}")
    example = (DEPLOY / "systemd" / "onepiece.env.example").read_text()
    assert "\nONEPIECE_PROXY_TOKEN=" in example
    for unit in (DEPLOY / "systemd").glob("*.service"):
        assert "0.0.0.0" not in unit.read_text(), unit.name


def test_etcd_requires_credentials_everywhere_it_is_deployed() -> None:
    """etcd's authentication is turned on before anything connects (the Kubernetes Job, the compose one-shot
    service that every etcd client waits for), and every etcd client holds the Secret with its URL (issue 16)."""
    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    job = by["onepiece-etcd-auth"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["onepiece", "etcd-auth"]
    assert {"name": "onepiece-secrets"} in [e.get("secretRef") for e in c["envFrom"]]
    secrets = {d["metadata"]["name"]: d["stringData"] for _, d in DOCS if d["kind"] == "Secret"}
    assert {"ETCD_ONEPIECE_PASSWORD", "ONEPIECE_ETCD_URL"} <= set(secrets["onepiece-secrets"])
    # root's password is the Job's alone: no serving pod can read it
    assert set(secrets["onepiece-etcd-root"]) == {"ETCD_ROOT_PASSWORD"}
    assert not any("ETCD_ROOT_PASSWORD" in s for n, s in secrets.items() if n != "onepiece-etcd-root")
    assert {"name": "onepiece-etcd-root"} in [e.get("secretRef") for e in c["envFrom"]]
    for name, d in _workloads():
        for c2 in d["spec"]["template"]["spec"]["containers"]:
            refs = [e.get("secretRef") for e in c2.get("envFrom", [])]
            assert ({"name": "onepiece-etcd-root"} in refs) == (d["metadata"]["name"] == "onepiece-etcd-auth"), name
    for name in ("onepiece-proxy", "onepiece-manager", "onepiece-node", "onepiece-web", "onepiece-celery",
                 "onepiece-reconciler"):
        for c in by[name]["spec"]["template"]["spec"]["containers"]:
            assert {"name": "onepiece-secrets"} in [e.get("secretRef") for e in c["envFrom"]], name
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    assert compose["x-onepiece-env"]["ONEPIECE_ETCD_URL"].startswith("http://onepiece:${ETCD_ONEPIECE_PASSWORD")
    services = compose["services"]
    assert services["etcd-auth"]["command"][:2] == ["onepiece", "etcd-auth"]
    assert services["etcd-auth"]["depends_on"] == {"etcd": {"condition": "service_healthy"}}
    clients = {n for n, b in services.items() if n != "etcd-auth" and {"etcd", "etcd-auth"} & set(b.get("depends_on", {}))}
    assert {"proxy", "manager", "node"} <= clients
    for name in clients:
        deps = services[name]["depends_on"]
        assert "etcd" not in deps, f"{name} must wait for etcd-auth, not just etcd"
        assert deps["etcd-auth"] == {"condition": "service_completed_successfully"}, name


def _web_server_commands() -> list[tuple[str, list[str]]]:
    """Every uvicorn command line of the web platform in deploy/: Kubernetes, compose, systemd."""
    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    (web,) = by["onepiece-web"]["spec"]["template"]["spec"]["containers"]
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    shell = compose["services"]["web"]["command"][-1]
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read(DEPLOY / "systemd" / "onepiece-web.service")
    return [("k8s", web["command"]), ("compose", shlex.split(shell.split("exec ", 1)[1])),
            ("systemd", shlex.split(cp["Service"]["ExecStart"]))]


def test_every_web_server_runs_with_onepiece_ups_flags() -> None:
    """uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told not to, and a sidecar or local reverse
    proxy makes every client 127.0.0.1: the lockout of guessers would then follow the client's own claim.
    Every deployment runs the web server with the launcher's flags (onepiece_launcher.up.WEB_SERVER_FLAGS)."""
    from onepiece_launcher.up import WEB_APP, WEB_SERVER_FLAGS

    flags = list(WEB_SERVER_FLAGS)
    for where, argv in _web_server_commands():
        assert Path(argv[0]).name == "uvicorn" and argv[1] == WEB_APP, (where, argv)
        assert any(argv[i:i + len(flags)] == flags for i in range(len(argv))), (where, argv, flags)
        assert "--proxy-headers" not in argv and "--forwarded-allow-ips" not in argv, (where, argv)


def test_every_long_running_service_is_restarted_when_it_exits() -> None:
    """Each deployment supervises every service as ``onepiece up`` does its children: Kubernetes pods restart
    their containers (and the serving ones are probed), compose restarts every service but its one-shot,
    systemd restarts every unit and never gives up (its default start limit would leave a unit failed)."""
    for name, d in _workloads():
        spec = d["spec"]["template"]["spec"]
        if d["kind"] == "Job":
            assert spec["restartPolicy"] == "OnFailure", name
            continue
        assert spec["restartPolicy"] == "Always", name
    by = {d["metadata"]["name"]: d for _, d in _workloads()}
    for workload in ("onepiece-web", "onepiece-proxy", "onepiece-manager", "onepiece-celery", "etcd",
                     "redis-primary", "redis-replica", "postgres"):
        for c in by[workload]["spec"]["template"]["spec"]["containers"]:
            assert "livenessProbe" in c, (workload, c["name"])  # a hung server is restarted too
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    for svc, body in compose.items():
        want = "on-failure" if svc == "etcd-auth" else "unless-stopped"
        assert body.get("restart") == want, (svc, body.get("restart"))
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.read_string(unit.read_text())
        assert cp["Service"]["Restart"] == "always" and float(cp["Service"]["RestartSec"]) > 0, unit.name
        assert cp["Unit"]["StartLimitIntervalSec"] == "0", unit.name
