"""torch tensors in and out (skipped without torch; torch is never a dependency)."""

from __future__ import annotations

import fake_server
import numpy as np
import pytest

from attnserve import Client, PageTable
from attnserve.reference import CacheMirror, check_close, gqa_reference
from attnserve.tensors import bf16_to_float, float_to_bf16, pack_tensor
from attnserve.torch_tensors import is_torch_tensor, pack_torch, tensor_to_torch
from attnserve.v1 import attention_pb2 as pb

torch = pytest.importorskip("torch")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bits_of(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a bf16 tensor."""
    return t.cpu().view(torch.int16).numpy().view(np.uint16)


def test_is_torch_tensor() -> None:
    assert is_torch_tensor(torch.zeros(1)) and not is_torch_tensor(np.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_tensors_travel_as_their_bits(device: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(64, 1024)
    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)
    message = pack_torch(t)
    assert message.dtype == pb.DTYPE_BF16 and list(message.shape) == [64, 1024]
    assert message.data == bits.astype("<u2").tobytes()  # NaN payloads included
    back = tensor_to_torch(message, device)
    assert back.dtype == torch.bfloat16 and back.device.type == device
    np.testing.assert_array_equal(bits_of(back), bits)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_float_tensors_are_rounded_like_numpy(dtype: str) -> None:
    x = torch.randn(3, 5, 7, dtype=getattr(torch, dtype))
    numpy_bits = float_to_bf16(x.float().numpy())
    assert pack_torch(x).data == pack_tensor(numpy_bits).data


def test_views_and_autograd_tensors() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    assert pack_torch(x.T).data == pack_tensor(x.detach().T.numpy()).data
    assert list(pack_torch(x[:, ::2]).shape) == [4, 3]


def test_integer_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="floating"):
        pack_torch(torch.zeros(3, dtype=torch.int16))


def test_fp32_messages_become_float32_tensors() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = tensor_to_torch(pack_tensor(x, pb.DTYPE_FP32))
    assert t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), x)


def test_prefill_with_torch_tensors(fake_address: str) -> None:
    with Client(fake_address, timeout=10.0) as client:
        table = PageTable(client, "gqa", 4)
        table.reserve("s", 6)
        csr = table.csr(["s"], [6])
        q = torch.randn(6, 4, 8).to(torch.bfloat16)
        k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8, dtype=torch.float16)
        result = client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v, return_lse=True)
        out, lse = result.output_torch(), result.lse_torch()
        assert out.dtype == torch.bfloat16 and out.shape == (6, 4, 8)
        np.testing.assert_array_equal(bits_of(out), result.output_bits())
        np.testing.assert_array_equal(out.float().numpy(), result.output)
        assert lse.dtype == torch.float32
        np.testing.assert_array_equal(lse.numpy(), result.lse)

        mirror = CacheMirror.for_pool(fake_server.gqa_pool())
        values = {n: bf16_to_float(bits_of(t.to(torch.bfloat16))) for n, t in (("k", k), ("v", v))}
        mirror.append(0, csr, values)
        expected, _ = gqa_reference(mirror, 0, csr, bf16_to_float(bits_of(q)))
        assert check_close(result.output, expected).ok
        table.free_all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_tensors_over_shared_memory_match_bytes(device: str, dtype: str) -> None:
    """torch tensors are converted to bf16 straight into the arena (copy_), CUDA ones copied
    to it; the outputs are the same bits as over bytes."""
    service = fake_server.FakeAttentionService([fake_server.gqa_pool()], shared_memory=True)
    server, address = fake_server.start(service)
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, h, 8, generator=gen).to(getattr(torch, dtype)).to(device)
                   for h in (4, 2, 2))  # fmt: skip
        outputs = {}
        for transport in ("bytes", "shm"):
            with Client(address, transport=transport) as client:
                table = PageTable(client, "gqa", 4)
                table.reserve("s", 5)
                csr = table.csr(["s"], q_lens=[5])
                result = client.prefill(0, q, csr, k_new=k, v_new=v, return_lse=True)
                assert service.seen[-1].q.HasField("region") == (transport == "shm")
                out = result.output_torch()
                assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
                outputs[transport] = (bits_of(out), result.lse_torch().numpy())
                table.free_all()
        np.testing.assert_array_equal(outputs["shm"][0], outputs["bytes"][0])
        np.testing.assert_array_equal(outputs["shm"][1], outputs["bytes"][1])
    finally:
        server.stop(grace=None)
