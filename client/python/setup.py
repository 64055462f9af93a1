"""Build hook of the attnserve client: generates the gRPC/protobuf stubs from the repo's proto/.

The stubs are never committed. `build_py` runs grpc_tools.protoc on attnserve/v1/*.proto and writes
attnserve/v1/{*_pb2.py,*_pb2.pyi,*_pb2_grpc.py,__init__.py}:
- into the build directory for a regular build (`pip install ./client/python`);
- into the source tree for an editable install (`pip install -e ./client/python`) or
  `python setup.py build_py --inplace` run in client/python (development).

The proto root is ../../proto relative to this file, or $ATTNSERVE_PROTO_DIR when set.
The runtime requirements are pinned to at least the grpcio/protobuf versions the stubs were
generated with, because generated code refuses to import under an older runtime.
"""

from __future__ import annotations

import os
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
    """grpcio/protobuf at least as new as the code generator, plus numpy."""
    from grpc_tools import grpc_version

    return [
        f"grpcio>={grpc_version.VERSION}",
        f"protobuf>={protobuf_gencode_version()}",
        "numpy>=1.22",
    ]


def protobuf_gencode_version() -> str:
    """The lowest protobuf runtime grpcio-tools declares for the code its protoc generates."""
    from importlib.metadata import requires

    for req in requires("grpcio-tools") or []:
        name, _, spec = req.split(";")[0].partition("protobuf")
        if name.strip():
            continue
        for clause in spec.split(","):
            if clause.strip().startswith(">="):
                return clause.strip()[2:]
    return "4.21"


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
