import numpy as np
import pytest
import torch

from rollhpc.transport import wire


def roundtrip(obj):
    header, buffers = wire.encode(obj)
    # as MPI would deliver
    received = [np.frombuffer(bytes(m), dtype=np.uint8).copy() for m in buffers]
    return wire.decode(header, received), header, buffers


def test_large_arrays_travel_outside_the_pickle():
    arr = np.arange(1 << 16, dtype=np.float64)
    back, header, buffers = roundtrip({"x": arr, "note": "hi"})
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert len(header) < 1024  # the header carries only the skeleton
    np.testing.assert_array_equal(back["x"], arr)
    assert back["note"] == "hi"


def test_small_arrays_stay_inline():
    back, _, buffers = roundtrip([np.ones(3, dtype=np.int32)])
    assert buffers == []
    assert back[0].tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
)
def test_torch_tensors_keep_dtype_and_shape(dtype):
    t = (torch.randn(128, 96) * 10).to(dtype)  # >= 12 KiB even for bool
    back, _, buffers = roundtrip((t, [t[:2]]))
    assert len(buffers) == 1  # the slice is small enough to go inline
    assert back[0].dtype == dtype and back[0].shape == t.shape
    assert torch.equal(back[0], t) and torch.equal(back[1][0], t[:2])


def test_non_contiguous_and_empty_arrays():
    a = np.arange(40000, dtype=np.int32).reshape(200, 200)[:, ::2]
    t = torch.arange(40000.0).reshape(200, 200).t()
    back, _, _ = roundtrip((a, t, np.zeros((0, 5))))
    np.testing.assert_array_equal(back[0], a)
    assert torch.equal(back[1], t)
    assert back[2].shape == (0, 5)


def test_gpu_tensor_is_refused_with_a_clear_error():
    class FakeDevice:  # a real CUDA tensor cannot exist on this machine; the check is on .device.type
        type = "cuda"

    class Cuda(torch.Tensor):
        @property
        def device(self):
            return FakeDevice()

    t = torch.zeros(10000).as_subclass(Cuda)
    with pytest.raises(TypeError, match="only CPU tensors"):
        wire.encode(t)


def test_large_receive_buffers_are_reused_only_once_nothing_refers_to_them():
    import torch

    from rollhpc.transport.mpi_channel import ReceiveBuffers

    pool, n = ReceiveBuffers(max_bytes=32 << 20), 2 << 20
    header, _ = wire.encode({"x": np.zeros(n // 8), "t": torch.zeros(n // 2, dtype=torch.float32)})
    first, second = pool.get(n), pool.get(2 * n)
    payload = wire.decode(header, [first, second])
    first_id = id(first)
    del first, second
    assert id(pool.get(n)) != first_id  # the decoded array still views it
    x, t = payload["x"], payload["t"]
    del payload
    assert id(pool.get(n)) != first_id  # so does x, alone
    del x
    # t (a torch tensor over the buffer) still holds its buffer: not this one
    held = pool.get(2 * n)
    assert not np.shares_memory(held, t.numpy())
    del held, t
    reused = pool.reused
    # nothing refers to it any more
    assert id(pool.get(n)) == first_id and pool.reused == reused + 1
    held = [pool.get(3 << 20) for _ in range(20)]  # 60 MiB handed out and held
    # the oldest are let go past max_bytes
    assert len(held) == 20 and sum(b.nbytes for b in pool._kept) <= 32 << 20
    # small ones are never kept
    assert pool.get(100).nbytes == 100 and pool.get(100) is not pool.get(100)
