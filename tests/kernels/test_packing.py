"""Sub-byte packing: fast path against the bit-by-bit reference, layouts, errors."""

import numpy as np
import pytest
import torch

from fewbits.kernels.packing import pack, pack_reference, unpack, unpack_reference

ALL_BITS = list(range(1, 9))
ORDERS = ["low_first", "high_first"]
LENGTHS = [0, 1, 2, 7, 8, 9, 100, 1001]


def random_codes(n, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.int64)


def nbytes(n, bits):
    return -(-n * bits // 8)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_fast_matches_reference(bits, order):
    for n in LENGTHS:
        codes = random_codes(n, bits, seed=1000 * bits + n)
        packed = pack(codes, bits, order)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == nbytes(n, bits)
        expected = pack_reference(codes.tolist(), bits, order)
        assert bytes(packed.numpy()) == expected, (bits, order, n)

        restored = unpack(packed, bits, n, order)
        assert restored.dtype == torch.uint8 and restored.shape == (n,)
        assert restored.tolist() == codes.tolist()
        assert unpack_reference(expected, bits, n, order) == codes.tolist()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_matches_reference_on_arbitrary_bytes(bits, order):
    # Any byte string whose padding bits are zero is a valid packed stream.
    for n in LENGTHS:
        gen = torch.Generator().manual_seed(7 * n + bits)
        data = torch.randint(0, 256, (nbytes(n, bits),), generator=gen, dtype=torch.uint8)
        spare = nbytes(n, bits) * 8 - n * bits
        if spare:
            keep = (0xFF << spare) & 0xFF if order == "high_first" else 0xFF >> spare
            data[-1] &= keep
        expected = unpack_reference(bytes(data.numpy()), bits, n, order)
        assert unpack(data, bits, n, order).tolist() == expected
        assert pack(unpack(data, bits, n, order), bits, order).tolist() == data.tolist()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_numpy_bit_stream_oracle(bits, order):
    # numpy.unpackbits is an independent reading of the stream: "little" bit
    # order is low_first's stream, "big" is high_first's.
    n = 999
    codes = random_codes(n, bits, seed=bits)
    packed = pack(codes.numpy(), bits, order)
    stream = np.unpackbits(packed, bitorder="little" if order == "low_first" else "big")
    assert not stream[n * bits :].any(), "padding bits must be zero"
    fields = stream[: n * bits].reshape(n, bits).astype(np.int64)
    if order == "low_first":
        weights = 1 << np.arange(bits)
    else:
        weights = 1 << np.arange(bits)[::-1]
    np.testing.assert_array_equal(fields @ weights, codes.numpy())


@pytest.mark.parametrize("order,bitorder", [("low_first", "little"), ("high_first", "big")])
def test_one_bit_equals_numpy_packbits(order, bitorder):
    codes = np.random.default_rng(0).integers(0, 2, size=1001, dtype=np.uint8)
    np.testing.assert_array_equal(pack(codes, 1, order), np.packbits(codes, bitorder=bitorder))


def test_known_layouts():
    assert pack(torch.tensor([1, 2]), 4, "low_first").tolist() == [0x21]
    assert pack(torch.tensor([1, 2]), 4, "high_first").tolist() == [0x12]
    assert pack(torch.tensor([0, 1, 2, 3]), 2, "low_first").tolist() == [0b11100100]
    assert pack(torch.tensor([0, 1, 2, 3]), 2, "high_first").tolist() == [0b00011011]
    assert pack(torch.tensor([0x3F, 0, 0, 0]), 6, "low_first").tolist() == [0x3F, 0, 0]
    assert pack(torch.tensor([0x3F, 0, 0, 0]), 6, "high_first").tolist() == [0xFC, 0, 0]
    # 3-bit: 8 codes -> 3 bytes; 5 codes -> ceil(15 / 8) = 2 bytes, padding zero.
    assert pack(torch.tensor([7, 0, 0, 0, 0, 0, 0, 7]), 3, "low_first").tolist() == [7, 0, 0xE0]
    assert pack(torch.tensor([1, 1, 1, 1, 1]), 3, "low_first").tolist() == [0b01001001, 0b00010010]
    # A trailing odd nibble: padding bits are zero.
    assert pack(torch.tensor([0xA, 0xB, 0xC]), 4, "low_first").tolist() == [0xBA, 0x0C]
    assert pack(torch.tensor([0xA, 0xB, 0xC]), 4, "high_first").tolist() == [0xAB, 0xC0]


def test_bitsandbytes_convention_is_high_first():
    # bitsandbytes packs 4-bit pairs as (first << 4) | second.
    codes = random_codes(1000, 4, seed=3)
    bnb_style = (codes[0::2] << 4) | codes[1::2]
    assert pack(codes, 4, "high_first").tolist() == bnb_style.tolist()


def test_torch_fp4x2_convention_is_low_first():
    # torch's float4_e2m1fn_x2 / ONNX uint4 keep element 0 in bits 3..0 and
    # element 1 in bits 7..4.  torch has no packed uint4 arithmetic on CPU to
    # compare against, so this asserts that documented nibble order.
    codes = random_codes(1000, 4, seed=4)
    torch_style = codes[0::2] | (codes[1::2] << 4)
    assert pack(codes, 4, "low_first").tolist() == torch_style.tolist()
    if hasattr(torch, "float4_e2m1fn_x2"):
        packed = pack(codes, 4, "low_first")
        # One byte per pair: the view is legal and keeps the pair count.
        assert packed.view(torch.float4_e2m1fn_x2).shape == (500,)


def test_eight_bits_is_identity():
    codes = torch.arange(256, dtype=torch.uint8)
    for order in ORDERS:
        packed = pack(codes, 8, order)
        assert packed.tolist() == codes.tolist()
        assert packed.data_ptr() != codes.data_ptr()
        assert unpack(packed, 8, 256, order).tolist() == codes.tolist()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64,
    ],
)
def test_integer_dtypes(dtype):
    codes = random_codes(101, 6, seed=5)
    assert pack(codes.to(dtype), 6).tolist() == pack(codes, 6).tolist()


@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int8, np.int16, np.uint16, np.uint32, np.int64, np.uint64]
)
def test_numpy_integer_dtypes(dtype):
    codes = random_codes(101, 7, seed=5).numpy()
    assert bytes(pack(codes.astype(dtype), 7)) == pack_reference(codes.tolist(), 7)


def test_numpy_in_numpy_out():
    codes = random_codes(77, 3, seed=6).numpy().astype(np.int32)
    packed = pack(codes, 3, "high_first")
    assert isinstance(packed, np.ndarray) and packed.dtype == np.uint8
    assert bytes(packed) == pack_reference(codes.tolist(), 3, "high_first")
    restored = unpack(packed, 3, 77, "high_first")
    assert isinstance(restored, np.ndarray) and restored.dtype == np.uint8
    np.testing.assert_array_equal(restored, codes)


def test_numpy_read_only_big_endian_and_reversed():
    codes = random_codes(50, 5, seed=7).numpy()
    expected = pack_reference(codes[::-1].tolist(), 5, "low_first")
    odd = codes.astype(">i4")[::-1]
    odd.flags.writeable = False
    assert bytes(pack(odd, 5)) == expected


def test_non_contiguous_packs_c_order_flattening():
    codes = random_codes(6 * 5, 4, seed=8).reshape(6, 5)
    transposed = codes.t()
    assert not transposed.is_contiguous()
    expected = pack_reference(transposed.contiguous().reshape(-1).tolist(), 4, "low_first")
    assert bytes(pack(transposed, 4).numpy()) == expected
    strided = codes[:, ::2]
    assert bytes(pack(strided, 4).numpy()) == pack_reference(strided.reshape(-1).tolist(), 4)
    np_t = codes.numpy().T
    assert bytes(pack(np_t, 4)) == pack_reference(np_t.reshape(-1).tolist(), 4)


def test_multidimensional_and_empty():
    codes = random_codes(24, 2, seed=9).reshape(2, 3, 4)
    assert pack(codes, 2).tolist() == pack(codes.reshape(-1), 2).tolist()
    empty = torch.zeros((0, 3), dtype=torch.int64)
    assert pack(empty, 5).shape == (0,)
    assert unpack(torch.zeros(0, dtype=torch.uint8), 5, 0).shape == (0,)
    # packed input of any shape is flattened
    packed = pack(codes, 2)
    assert unpack(packed.reshape(2, 3), 2, 24).tolist() == codes.reshape(-1).tolist()


def test_large_input_round_trip():
    codes = random_codes(1 << 16, 7, seed=10)
    for order in ORDERS:
        restored = unpack(pack(codes, 7, order), 7, codes.numel(), order)
        assert torch.equal(restored, codes.to(torch.uint8))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bits", [0, 9, -1, 4.0, "4", True, None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack(torch.tensor([0]), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack(torch.zeros(1, dtype=torch.uint8), bits, 1)


def test_bad_order():
    for call in (
        lambda: pack(torch.tensor([1]), 4, order="little"),
        lambda: unpack(torch.zeros(1, dtype=torch.uint8), 4, 1, order="msb"),
        lambda: pack_reference([1], 4, order="little"),
    ):
        with pytest.raises(ValueError, match="low_first.*high_first"):
            call()


@pytest.mark.parametrize(
    "codes",
    [
        torch.tensor([0.0, 1.0]),
        torch.tensor([0, 1], dtype=torch.float16),
        torch.tensor([1 + 0j]),
        torch.tensor([True, False]),
        np.array([0.0, 1.0]),
        np.array([True, False]),
    ],
    ids=["f32", "f16", "complex", "bool", "np-f64", "np-bool"],
)
def test_non_integer_codes(codes):
    with pytest.raises(TypeError, match="integer dtype"):
        pack(codes, 4)


def test_codes_not_an_array():
    with pytest.raises(TypeError):
        pack([1, 2], 4)


@pytest.mark.parametrize("values", [[0, 16], [-1, 3], [5, 255]])
def test_codes_out_of_range(values):
    with pytest.raises(ValueError, match=r"min .*max .*\[0, 15\]"):
        pack(torch.tensor(values), 4)
    with pytest.raises(ValueError, match="out of range"):
        pack(np.array(values, dtype=np.int16), 4)
    with pytest.raises(ValueError, match="out of range"):
        pack_reference(values, 4)


def test_out_of_range_message_names_values():
    with pytest.raises(ValueError, match=r"min -3, max 9"):
        pack(torch.tensor([-3, 9, 1]), 3)


def test_huge_unsigned_codes_reported_as_large():
    with pytest.raises(ValueError, match=f"max {2**64 - 1}"):
        pack(np.array([1, 2**64 - 1], dtype=np.uint64), 4)
    huge = torch.tensor([1, 2**63], dtype=torch.uint64)
    with pytest.raises(ValueError, match=r"max >= 2\*\*63"):
        pack(huge, 4)


def test_packed_not_uint8():
    with pytest.raises(TypeError, match="uint8"):
        unpack(torch.zeros(1, dtype=torch.int8), 4, 2)
    with pytest.raises(TypeError, match="uint8"):
        unpack(np.zeros(1, dtype=np.int32), 4, 2)


@pytest.mark.parametrize("count,length", [(3, 1), (3, 3), (1, 0), (0, 1)])
def test_packed_wrong_length(count, length):
    expected = nbytes(count, 4)
    with pytest.raises(ValueError, match=f"has {length} bytes.*exactly {expected} bytes"):
        unpack(torch.zeros(length, dtype=torch.uint8), 4, count)
    with pytest.raises(ValueError, match=f"exactly {expected} bytes"):
        unpack_reference(bytes(length), 4, count)


def test_negative_count():
    with pytest.raises(ValueError, match="count"):
        unpack(torch.zeros(0, dtype=torch.uint8), 4, -1)
    with pytest.raises(ValueError, match="count"):
        unpack_reference(b"", 4, -1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", ALL_BITS)
def test_cuda_matches_cpu(bits):
    codes = random_codes(4099, bits, seed=bits)
    for order in ORDERS:
        packed = pack(codes.cuda(), bits, order)
        assert packed.is_cuda
        assert torch.equal(packed.cpu(), pack(codes, bits, order))
        restored = unpack(packed, bits, codes.numel(), order)
        assert restored.is_cuda
        assert torch.equal(restored.cpu(), codes.to(torch.uint8))
