"""Elementwise activations against float64 numpy references, including extreme inputs."""
import numpy as np
import pytest

import specd.native as sn

# The ops evaluate in double and round once: within 1 F32 ulp (2^-23 relative) of the float64
# reference, and within one denormal step (1.4e-45) for results like sigmoid(-100) ~ 3.7e-44.
RTOL = 1.2e-7
ATOL = 1.5e-45

SHAPES = [(1,), (7,), (3, 5), (2, 3, 257), (0, 4), (4, 1, 1000)]
EXTREMES = np.array([-1e4, -100, -88.7, -50, -20.5, -1, -1e-30, 0, 1e-30, 1e-3, 1, 19.99, 20, 20.01, 50,
                     88.7, 100, 1e4], np.float32)


def sigmoid64(x):
    x = x.astype(np.float64)
    return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


def silu64(x):
    return x.astype(np.float64) * sigmoid64(x)


def softplus64(x):
    x = x.astype(np.float64)
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


UNARY = {"silu": silu64, "sigmoid": sigmoid64, "softplus": softplus64}


def check(y, ref):
    np.testing.assert_allclose(y.numpy(), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("shape", SHAPES)
def test_unary(rng, name, shape):
    x = (rng.standard_normal(shape) * 8).astype(np.float32)
    y = getattr(sn, name)(x)
    assert y.shape == shape
    check(y, UNARY[name](x))


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_extremes(name):
    y = getattr(sn, name)(EXTREMES).numpy()
    assert np.isfinite(y).all()
    check(getattr(sn, name)(EXTREMES), UNARY[name](EXTREMES))


def test_extreme_values_exact():
    x = np.array([-100, 100], np.float32)
    np.testing.assert_array_equal(sn.softplus(x).numpy(), np.float32([np.exp(-100.0), 100.0]))
    np.testing.assert_array_equal(sn.sigmoid(x).numpy(), np.float32([np.exp(-100.0), 1.0]))
    np.testing.assert_array_equal(sn.silu(x).numpy(), np.float32([-100 * np.exp(-100.0), 100.0]))


def test_softplus_threshold_continuity():
    # Around the x > 20 switch the two branches agree to the last bit or so.
    x = np.nextafter(np.float32(20), np.float32([-np.inf, np.inf])).astype(np.float32)
    x = np.concatenate([x, np.float32([20.0])])
    np.testing.assert_allclose(sn.softplus(x).numpy(), softplus64(x), rtol=1e-7)


@pytest.mark.parametrize("shape", SHAPES)
def test_binary(rng, shape):
    a = (rng.standard_normal(shape) * 10).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(sn.mul(a, b).numpy(), a * b)  # one F32 rounding, as numpy
    np.testing.assert_array_equal(sn.add(a, b).numpy(), a + b)
    check(sn.swiglu(a, b), silu64(a) * b.astype(np.float64))


def test_swiglu_on_fused_gate_up_slices(rng):
    gu = rng.standard_normal((6, 2 * 300)).astype(np.float32)
    gate, up = gu[:, :300], gu[:, 300:]  # row-strided views, no copy
    check(sn.swiglu(gate, up), silu64(gate) * up.astype(np.float64))
    check(sn.silu(gate), silu64(gate))


def test_bad_input():
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        sn.swiglu(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        sn.mul(np.ones(4, np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        sn.add(np.ones((2, 1), np.float32), np.ones((2, 4), np.float32))  # b is not one row of a's width
    with pytest.raises(ValueError, match="x must be F32"):
        sn.silu(np.ones(3, np.float16))
    with pytest.raises(ValueError, match="x must have a contiguous last dimension"):
        sn.sigmoid(np.ones((2, 8), np.float32)[:, ::2])


@pytest.mark.parametrize("a_shape,b_shape", [((5, 7), (7,)), ((5, 7), (1, 7)), ((3, 4, 6), (6,)), ((1, 9), (9,)),
                                             ((8,), (1, 8))])
def test_broadcast_add_mul(rng, a_shape, b_shape):
    """b of shape [H] / [1, H] is broadcast over a's rows: exactly numpy's a + b / a * b (F32)."""
    a = (rng.standard_normal(a_shape) * 10).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    want_add, want_mul = (a + b).reshape(a_shape), (a * b).reshape(a_shape)
    got_add, got_mul = sn.add(a, b).numpy(), sn.mul(a, b).numpy()
    assert got_add.shape == a_shape and got_mul.shape == a_shape  # a's shape, whatever b's rank
    np.testing.assert_array_equal(got_add, want_add)
    np.testing.assert_array_equal(got_mul, want_mul)


def test_broadcast_on_strided_rows(rng):
    a = rng.standard_normal((4, 20)).astype(np.float32)[:, 5:15]  # row-strided view
    b = rng.standard_normal((1, 10)).astype(np.float32)
    np.testing.assert_array_equal(sn.add(a, b).numpy(), a + b)


def test_broadcast_bad_shapes():
    with pytest.raises(ValueError, match=r"a and b must have the same shape \(or b of shape \[H\]"):
        sn.add(np.ones((3, 4), np.float32), np.ones((2, 4), np.float32))  # two rows do not broadcast
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        sn.mul(np.ones((3, 4), np.float32), np.ones((4, 1), np.float32))  # a column is not a row
    with pytest.raises(ValueError, match="a and b must have the same shape"):
        sn.mul(np.ones((3, 4), np.float32), np.ones((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        sn.swiglu(np.ones((3, 4), np.float32), np.ones(4, np.float32))  # swiglu never broadcasts
