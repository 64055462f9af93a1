"""The Dockerfile: hadolint finds nothing (an inline ignore must say why), and the image is
built the way deploy/README.md says: multi-stage, CUDA devel for the build only, non-root,
the server as entry point, CUDA architectures as a build argument."""

from __future__ import annotations

import re

from conftest import DOCKERFILE, run

TEXT = DOCKERFILE.read_text()
STAGES = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", TEXT, re.M)


def test_hadolint_finds_nothing(hadolint: str) -> None:
    result = run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)])
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_every_inline_ignore_is_justified() -> None:
    lines = TEXT.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint ignore=([\w,]+)", line)
        if m:
            before = "\n".join(lines[max(0, i - 4) : i])
            for rule in m.group(1).split(","):
                assert rule in before, f"line {i + 1}: say why {rule} is ignored, just above"


def test_multi_stage_build_and_slim_runtime() -> None:
    assert len(STAGES) >= 2, "a build stage and a runtime stage"
    build_image, runtime_image = STAGES[0][0], STAGES[-1][0]
    assert "nvidia/cuda" in build_image and "devel" in build_image
    assert "devel" not in runtime_image and "nvidia/cuda" not in runtime_image
    runtime = TEXT.split(f"FROM {runtime_image}", 1)[1]
    assert "apt-get install" not in runtime, (
        "the runtime stage carries the server and its libraries"
    )
    assert re.search(r"^COPY --from=build .*attnserve", runtime, re.M)


def test_base_images_are_pinned() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", TEXT, re.MULTILINE))
    for image, _ in STAGES:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        last = resolved.rsplit("/", 1)[-1]
        pinned = "@sha256:" in resolved or (":" in last and not last.endswith(":latest"))
        assert pinned, f"FROM {resolved}: pin a tag (not latest) or a digest"


def test_runs_as_a_non_root_user() -> None:
    users = re.findall(r"^USER (\S+)$", TEXT, re.M)
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]}"
    assert user.isdigit(), "a numeric UID lets Kubernetes verify runAsNonRoot"


def test_cuda_architectures_are_a_build_argument() -> None:
    m = re.search(r'^ARG CUDA_ARCHS="([^"]+)"', TEXT, re.M)
    assert m, "ARG CUDA_ARCHS with a default"
    archs = set(m.group(1).split(";"))
    assert {"90a-real", "100-real"} <= archs, "H100/H200 and B200"
    assert 'CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}"' in TEXT
    # The image ships only what every CI run compiles: the build's default architectures.
    cmake = (DOCKERFILE.parent / "cmake" / "AttnCuda.cmake").read_text()
    default = re.search(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"]+)"\)', cmake)
    assert default, "cmake/AttnCuda.cmake sets the default architectures"
    assert archs <= set(default.group(1).split(";")), f"{archs} beyond {default.group(1)}"


def test_entrypoint_is_the_server_with_overridable_flags() -> None:
    assert re.search(r'^ENTRYPOINT \["/usr/local/bin/attnserve"\]$', TEXT, re.M)
    cmd = re.search(r"^CMD \[(.*)\]$", TEXT, re.M)
    assert cmd and "--listen_address=0.0.0.0:50051" in cmd.group(1)


def test_oci_labels() -> None:
    for key in ("title", "description", "version", "revision"):
        assert f"org.opencontainers.image.{key}=" in TEXT, key
