import numpy as np
import pytest
import torch

from rollhpc.transport import wire


def roundtrip(obj):
    header, buffers = wire.encode(obj)
    received = [np.frombuffer(bytes(m), dtype=np.uint8).copy() for m in buffers]  # as MPI would deliver
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
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
