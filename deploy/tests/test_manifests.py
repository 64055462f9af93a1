"""Kubernetes manifests: every kustomization renders, every object passes its schema in strict
mode, the server objects follow the deployment policy, and the rendered config and container
args start the real server."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from google.protobuf import text_format
from jsonschema import Draft202012Validator

from conftest import (
    DEPLOY,
    DOCKERFILE,
    KUSTOMIZATIONS,
    OVERLAYS,
    SERVER_BIN,
    SERVER_KUSTOMIZATIONS,
    container_flags,
    effective_settings,
    host_of,
    kid,
    only,
    port_of,
)
from server_process import Server, free_port

# Oldest Kubernetes the manifests support (native gRPC probes are GA from 1.27) and the newest
# schema kubernetes-validate ships; every object is checked against both.
K8S_VERSIONS = ["1.27.0", "1.37.0"]
SCHEMAS = DEPLOY / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor.schema.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule.schema.yaml",
}
GPU = "nvidia.com/gpu"
GPU_MEMORY_ANNOTATION = "attnserve.dev/gpu-memory-bytes"
GIB = 1 << 30
# Pools must leave this much of the GPU free: the CUDA context, and per lane a 256 MiB split-KV
# workspace plus device staging (deploy/README.md, "Sizing the pools").
MIN_HEADROOM_BYTES, MIN_HEADROOM_FRACTION = 8 * GIB, 0.10
# terminationGracePeriodSeconds >= preStop + drain deadline + this (final shutdown, exit).
GRACE_MARGIN_S = 10
MLA_ROW_ELEMENTS = 576  # 512 ckv + 64 kpe
BF16_BYTES = 2
HEALTH_SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


# ---- helpers -----------------------------------------------------------------------------------


def strict_validate(obj: dict, version: str) -> None:
    """Raises when obj does not match its kind's schema; unknown fields are errors."""
    schema_path = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema_path is not None:
        schema = yaml.safe_load(schema_path.read_text())
        Draft202012Validator(schema).validate(obj)
        return
    kubernetes_validate.validate(obj, version, strict=True)


def pod_spec(objects: list[dict]) -> dict:
    return only(objects, "StatefulSet")["spec"]["template"]["spec"]


def server_container(objects: list[dict]) -> dict:
    containers = pod_spec(objects)["containers"]
    assert [c["name"] for c in containers] == ["attnserve"], "one container, named attnserve"
    return containers[0]


def config_map(objects: list[dict]) -> dict:
    """The ConfigMap the server's --config file comes from."""
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    container = server_container(objects)
    flags = container_flags(container["args"])
    config_path = Path(flags["config"])
    mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    assert len(mounts) == 1, f"no volume mounted at {config_path.parent}"
    name = volumes[mounts[0]["name"]]["configMap"]["name"]
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    assert len(maps) == 1, f"the StatefulSet mounts ConfigMap {name}, which is not rendered"
    assert config_path.name in maps[0]["data"], f"ConfigMap {name} has no key {config_path.name}"
    return maps[0]


def config_text(objects: list[dict]) -> str:
    flags = container_flags(server_container(objects)["args"])
    return config_map(objects)["data"][Path(flags["config"]).name]


def parse_config(server_config_class, text: str):
    config = server_config_class()
    text_format.Parse(text, config)  # unknown fields and bad values raise ParseError
    return config


def settings(objects: list[dict], server_config_class):
    return effective_settings(
        server_container(objects)["args"], parse_config(server_config_class, config_text(objects))
    )


def bytes_per_page(pool) -> int:
    """The server's PoolGeometry::BytesPerPage (all layers, bf16)."""
    gqa = pool.kind == 1  # POOL_KIND_GQA
    per_token = 2 * pool.num_kv_heads * pool.head_dim if gqa else MLA_ROW_ELEMENTS
    return pool.num_layers * pool.page_size * per_token * BF16_BYTES


def pool_pages(pool) -> int:
    return pool.num_pages if pool.num_pages > 0 else pool.capacity_bytes // bytes_per_page(pool)


def prestop_seconds(container: dict) -> int:
    """How long the preStop hook holds SIGTERM back (sleep action or exec of sleep)."""
    hook = container["lifecycle"]["preStop"]
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert Path(command[0]).name == "sleep" and len(command) == 2, f"unexpected preStop {command}"
    return int(command[1])


def image_is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


SERVER_IDS = [kid(k) for k in SERVER_KUSTOMIZATIONS]
server_kustomizations = pytest.mark.parametrize("directory", SERVER_KUSTOMIZATIONS, ids=SERVER_IDS)


# ---- rendering and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[kid(k) for k in KUSTOMIZATIONS])
def test_kustomization_renders(rendered, directory: Path) -> None:
    objects = rendered(directory)
    assert objects
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[kid(k) for k in KUSTOMIZATIONS])
def test_objects_match_their_schema_strictly(rendered, directory: Path, version: str) -> None:
    failures = []
    for obj in rendered(directory):
        try:
            strict_validate(obj, version)
        except kubernetes_validate.SchemaNotFoundError:
            failures.append(
                f"{obj['kind']} ({obj['apiVersion']}): no schema; add one to deploy/schemas"
            )
        except Exception as e:  # jsonschema and kubernetes_validate errors
            path = ".".join(str(p) for p in getattr(e, "path", []))
            failures.append(
                f"{obj['kind']}/{obj['metadata']['name']} {path}: {getattr(e, 'message', e)}"
            )
    assert not failures, "\n".join(failures)


def test_every_crd_schema_is_used(rendered) -> None:
    kinds = {(o["apiVersion"], o["kind"]) for d in KUSTOMIZATIONS for o in rendered(d)}
    assert set(CRD_SCHEMAS) <= kinds, "a CRD schema is unused: remove it or test it"


@pytest.mark.parametrize(
    "kind, mutate",
    [
        ("StatefulSet", lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriod=5)),
        (
            "StatefulSet",
            lambda o: o["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
                readOnlyRootFS=True
            ),
        ),
        ("Service", lambda o: o["spec"].update(clusterIp="None")),
        ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(intervall="30s")),
        ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="30 seconds")),
        ("ServiceMonitor", lambda o: o["spec"].update(selectors={})),
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update(fro="5m")),
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update(record="x")),
    ],
    ids=[
        "sts-unknown-field",
        "container-unknown-field",
        "svc-misspelt",
        "sm-unknown-field",
        "sm-bad-duration",
        "sm-misspelt-selector",
        "rule-unknown-field",
        "rule-alert-and-record",
    ],
)
def test_strict_validation_rejects_mistakes(rendered, kind: str, mutate) -> None:
    """The checks above would catch a misspelt field: the validators really are strict."""
    obj = copy.deepcopy(only(rendered(SERVER_KUSTOMIZATIONS[0]), kind))
    mutate(obj)
    for version in K8S_VERSIONS:
        with pytest.raises(
            Exception, match=r"(?i)additional properties|does not match|valid under"
        ):
            strict_validate(obj, version)


# ---- deployment policy -------------------------------------------------------------------------


@server_kustomizations
def test_one_gpu_per_server(rendered, directory: Path) -> None:
    resources = server_container(rendered(directory))["resources"]
    assert int(resources["limits"][GPU]) == 1
    assert int(resources.get("requests", {}).get(GPU, 1)) == 1


@server_kustomizations
def test_cpu_and_memory_requests_and_limits(rendered, directory: Path) -> None:
    resources = server_container(rendered(directory))["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), f"{kind} must set cpu and memory"


@server_kustomizations
def test_grpc_probes_on_the_grpc_port(rendered, directory: Path, server_config_class) -> None:
    objects = rendered(directory)
    container = server_container(objects)
    port = port_of(settings(objects, server_config_class).listen_address)
    for probe in ("readinessProbe", "livenessProbe"):
        assert probe in container, f"{probe} missing"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
            assert container[probe]["grpc"]["port"] == port, f"{probe} probes the wrong port"
            # Liveness and readiness differ: a draining server is not ready but alive.
            want = "attnserve.live" if probe == "livenessProbe" else "attnserve.ready"
            assert container[probe]["grpc"].get("service") == want, f"{probe} probes {want}"


@server_kustomizations
def test_grace_period_covers_prestop_and_drain(
    rendered, directory: Path, server_config_class
) -> None:
    objects = rendered(directory)
    container = server_container(objects)
    drain_s = settings(objects, server_config_class).drain_timeout_seconds
    grace_s = pod_spec(objects)["terminationGracePeriodSeconds"]
    prestop_s = prestop_seconds(container)
    assert prestop_s >= 1, "preStop must give the endpoints time to drop the pod"
    assert grace_s >= prestop_s + drain_s + GRACE_MARGIN_S, (
        f"terminationGracePeriodSeconds {grace_s} < preStop {prestop_s} + drain {drain_s} "
        f"+ {GRACE_MARGIN_S}"
    )
    # A draining server reports NOT_SERVING: liveness must not restart it before the drain ends.
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > drain_s


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[kid(k) for k in KUSTOMIZATIONS])
def test_no_latest_or_untagged_images(rendered, directory: Path) -> None:
    for obj in rendered(directory):
        if obj["kind"] not in ("StatefulSet", "Deployment", "DaemonSet", "Job", "Pod"):
            continue
        spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert image_is_pinned(c["image"]), f"{c['image']}: pin a tag (not latest) or a digest"


@server_kustomizations
def test_ports_match_the_server_settings(rendered, directory: Path, server_config_class) -> None:
    objects = rendered(directory)
    s = settings(objects, server_config_class)
    grpc_port, metrics_port = port_of(s.listen_address), s.metrics_port
    assert metrics_port > 0, "the metrics endpoint must be on"
    container_ports = {p["name"]: p["containerPort"] for p in server_container(objects)["ports"]}
    assert container_ports == {"grpc": grpc_port, "metrics": metrics_port}

    service = only(objects, "Service")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, port in (("grpc", grpc_port), ("metrics", metrics_port)):
        target = service_ports[name].get("targetPort", service_ports[name]["port"])
        assert target in (name, port), f"Service port {name} targets {target}, not {port}"

    monitor = only(objects, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint.get("path", "/metrics") == "/metrics"

    # The image's defaults agree (docker run without args).
    dockerfile = DOCKERFILE.read_text()
    exposed = {
        int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()
    }
    assert {grpc_port, metrics_port} <= exposed


@server_kustomizations
def test_server_listens_on_the_pod_address(rendered, directory: Path, server_config_class) -> None:
    """Probes and peers reach the pod IP; a loopback listener would never become ready."""
    host = host_of(settings(rendered(directory), server_config_class).listen_address)
    assert host in ("0.0.0.0", "[::]"), f"listen host {host}"


@server_kustomizations
def test_security_context(rendered, directory: Path) -> None:
    objects = rendered(directory)
    pod = pod_spec(objects).get("securityContext", {})
    container = server_container(objects)["securityContext"]
    assert container.get("runAsNonRoot", pod.get("runAsNonRoot")) is True
    assert container.get("runAsUser", pod.get("runAsUser", 1)) != 0
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container.get("privileged", False) is False
    assert "ALL" in container["capabilities"]["drop"] and not container["capabilities"].get("add")
    seccomp = container.get("seccompProfile", pod.get("seccompProfile", {}))
    assert seccomp.get("type") == "RuntimeDefault"
    assert pod_spec(objects)["automountServiceAccountToken"] is False


@server_kustomizations
def test_statefulset_behind_a_headless_service(rendered, directory: Path) -> None:
    objects = rendered(directory)
    sts, service = only(objects, "StatefulSet"), only(objects, "Service")
    assert service["spec"]["clusterIP"] == "None", "a load-balanced Service would mix pods"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = only(objects, "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "attnserve", (
        "the alerts and the dashboard select job=attnserve"
    )


@server_kustomizations
def test_disruption_budget(rendered, directory: Path) -> None:
    objects = rendered(directory)
    pdb = only(objects, "PodDisruptionBudget")
    pod_labels = only(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1 or "minAvailable" in pdb["spec"]


@pytest.mark.parametrize("directory", OVERLAYS, ids=[kid(k) for k in OVERLAYS])
def test_overlays_pick_their_gpu_nodes(rendered, directory: Path) -> None:
    spec = pod_spec(rendered(directory))
    selector = spec.get("nodeSelector", {})
    terms = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    keys = set(selector) | {e["key"] for t in terms for e in t.get("matchExpressions", [])}
    assert any(k.startswith("nvidia.com/gpu.") for k in keys), "select nodes by their GPU label"


# ---- the server's config -----------------------------------------------------------------------


@server_kustomizations
def test_config_parses_as_a_server_config(rendered, directory: Path, server_config_class) -> None:
    config = parse_config(server_config_class, config_text(rendered(directory)))
    assert config.backend == "cuda", "a GPU pod must not fall back to the CPU backend"
    names = [p.name for p in config.pools]
    assert names and len(names) == len(set(names))


@server_kustomizations
def test_pools_fit_the_gpu_with_headroom(rendered, directory: Path, server_config_class) -> None:
    objects = rendered(directory)
    annotations = config_map(objects)["metadata"].get("annotations", {})
    assert GPU_MEMORY_ANNOTATION in annotations, f"annotate the config with {GPU_MEMORY_ANNOTATION}"
    gpu_bytes = int(annotations[GPU_MEMORY_ANNOTATION])
    config = parse_config(server_config_class, config_text(objects))
    pools_bytes = sum(bytes_per_page(p) * pool_pages(p) for p in config.pools)
    headroom = max(MIN_HEADROOM_BYTES, int(MIN_HEADROOM_FRACTION * gpu_bytes))
    assert pools_bytes + headroom <= gpu_bytes, (
        f"pools {pools_bytes / GIB:.1f} GiB + headroom {headroom / GIB:.1f} GiB > "
        f"{gpu_bytes / GIB:.1f} GiB"
    )


@server_kustomizations
def test_rendered_config_and_args_start_the_real_server(
    rendered, directory: Path, api, tmp_path: Path
) -> None:
    """The container's args and ConfigMap, with the pools shrunk to 16 pages and the CPU backend
    on loopback, start the real binary: flags and config are accepted, the pools have the
    geometry (and the bytes per page the sizing above assumes), health is SERVING, and SIGTERM
    drains and exits 0."""
    objects = rendered(directory)
    config = parse_config(api.message("ServerConfig"), config_text(objects))
    expected = {p.name: (bytes_per_page(p), p) for p in config.pools}
    for pool in config.pools:
        pool.ClearField("capacity_bytes")
        pool.num_pages = 16
    config_file = tmp_path / "server.textproto"
    config_file.write_text(text_format.MessageToString(config))
    args = [
        f"--config={config_file}" if a.startswith("--config=") else a
        for a in server_container(objects)["args"]
    ]
    args += [
        "--listen_address=127.0.0.1:0",
        f"--metrics_port={free_port()}",
        "--backend=cpu",
        "--cpu_threads=1",
    ]
    server = Server(SERVER_BIN, args, tmp_path / "server.log").start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            pools = {p.name: p for p in api.call(channel, "GetServerInfo").pools}
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            # The services the probes name (HealthCheckRequest{service}: tag 0x0a, length).
            probed = {probe["grpc"].get("service", "")
                      for name, probe in server_container(objects).items()
                      if name.endswith("Probe")}  # fmt: skip
            health = {s: check(b"\x0a" + bytes([len(s)]) + s.encode(), timeout=10)
                      for s in probed}  # fmt: skip
        assert health == dict.fromkeys(probed, HEALTH_SERVING), health
        assert set(pools) == set(expected)
        for name, (page_bytes, pool) in expected.items():
            info = pools[name]
            assert info.bytes_per_page == page_bytes, f"pool {name}: sizing formula is off"
            assert (info.num_layers, info.page_size, info.num_qo_heads) == (
                pool.num_layers,
                pool.page_size,
                pool.num_qo_heads,
            )
    finally:
        code = server.stop()
    assert code == 0, f"exit {code} after SIGTERM:\n{server.log()}"
