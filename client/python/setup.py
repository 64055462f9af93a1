"""Build hook of the attnserve client: generates the gRPC/protobuf stubs from the repo's proto/.

The stubs are never committed. `build_py` runs grpc_tools.protoc on attnserve/v1/*.proto and writes
attnserve/v1/{*_pb2.py,*_pb2.pyi,*_pb2_grpc.py,__init__.py}:
- into the build directory for a regular build (`pip install ./client/python`);
- into the source tree for an editable install (`pip install -e ./client/python`) or
  `python setup.py build_py --inplace` run in client/python (development).

The proto root is ../../proto relative to this file, or $ATTNSERVE_PROTO_DIR when set.
The runtime requirements are at least the grpcio/protobuf versions the generated code demands
(runtime_requirements), because generated code refuses to import under an older runtime; the
generator is pinned in pyproject.toml so that those floors stay low.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_PACKAGE = Path("attnserve") / "v1"


def proto_root() -> Path:
    """Directory that contains attnserve/v1/*.proto."""
    root = Path(os.environ.get("ATTNSERVE_PROTO_DIR", HERE.parent.parent / "proto")).resolve()
    if not (root / PROTO_PACKAGE).is_dir():
        raise RuntimeError(
            f"attnserve: no {PROTO_PACKAGE}/*.proto under {root}; "
            "set ATTNSERVE_PROTO_DIR to the repo's proto/ directory"
        )
    return root


def generate_stubs(out_dir: Path) -> list[Path]:
    """Runs protoc + the gRPC plugin into out_dir; returns the files written."""
    from grpc_tools import protoc  # build requirement, imported only when generating

    root = proto_root()
    protos = sorted((root / PROTO_PACKAGE).glob("*.proto"))
    target = out_dir / PROTO_PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(root)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"attnserve: protoc failed on {[p.name for p in protos]}")
    init = target / "__init__.py"
    init.write_text('"""Generated attnserve.v1 stubs (see client/python/setup.py)."""\n')
    return sorted(target.glob("*_pb2*.py*")) + [init]


def runtime_requirements() -> list[str]:
    """grpcio/protobuf at least as new as the generated code demands, plus numpy.

    The floors are read from the code the generator writes, so they hold for whichever
    grpcio-tools built the package: protobuf >= the "Protobuf Python Version" protoc stamps into
    *_pb2.py (newer runtimes accept older generated code; protobuf's runtime_version check
    rejects the reverse), and grpcio >= the GRPC_GENERATED_VERSION the gRPC plugin checks at
    import (grpcio-tools 1.63 and later) or, without that check, the plugin's own minor release.
    pyproject.toml pins the generator per Python version so the floors stay low; check_floor.sh
    installs the package beside exactly these versions and runs the unit tests there.
    """
    with tempfile.TemporaryDirectory() as scratch:
        stubs = generate_stubs(Path(scratch))
        return [
            f"grpcio>={grpcio_floor(stubs)}",
            f"protobuf>={protobuf_floor(stubs)}",
            "numpy>=1.22",
        ]


def protobuf_floor(stubs: list[Path]) -> str:
    """The newest "Protobuf Python Version" stamped into the generated *_pb2.py files."""
    stamp = re.compile(r"^# Protobuf Python Version: (\d+\.\d+\.\d+)", re.MULTILINE)
    versions = [m.group(1) for p in stubs if p.name.endswith("_pb2.py")
                for m in [stamp.search(p.read_text())] if m]  # fmt: skip
    if not versions:
        raise RuntimeError("attnserve: protoc wrote no 'Protobuf Python Version' stamp")
    return max(versions, key=_version_key)


def grpcio_floor(stubs: list[Path]) -> str:
    """The grpcio the generated *_pb2_grpc.py files check for, else the plugin's minor release."""
    from importlib.metadata import version

    check = re.compile(r"^GRPC_GENERATED_VERSION = '(\d+\.\d+\.\d+)'", re.MULTILINE)
    versions = [m.group(1) for p in stubs if p.name.endswith("_pb2_grpc.py")
                for m in [check.search(p.read_text())] if m]  # fmt: skip
    if versions:
        return max(versions, key=_version_key)
    major, minor = version("grpcio-tools").split(".")[:2]
    return f"{major}.{minor}.0"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


class BuildPyWithStubs(build_py):
    """build_py that first generates the attnserve.v1 stubs."""

    user_options = build_py.user_options + [
        ("inplace", None, "write the generated stubs into the source tree"),
    ]
    boolean_options = build_py.boolean_options + ["inplace"]

    def initialize_options(self) -> None:
        super().initialize_options()
        self.inplace = False
        self._stubs: list[Path] = []

    def run(self) -> None:
        in_source = self.inplace or self.editable_mode
        self._stubs = generate_stubs(HERE if in_source else Path(self.build_lib))
        super().run()

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode or self.inplace:
            return outputs
        return outputs + [str(p) for p in self._stubs]


setup(
    cmdclass={"build_py": BuildPyWithStubs},
    install_requires=runtime_requirements(),
)
