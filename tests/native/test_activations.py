"""Elementwise activations against float64 numpy references, including extreme inputs; gdn_gates bit for bit
against the composition of ops it fuses."""
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


# ------------------------------------------- gdn_gates: bit for bit the composition it fuses

SPECIAL = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e4, -1e4, 20.0, 19.99, 20.01, 88.7, -88.7, -100, 1e-30],
                   np.float32)


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def gate_inputs(rng, t, h):
    """a, b with large |a| (softplus's x > 20 branch), negatives, zeros and a sprinkling of inf / NaN."""
    a = (rng.standard_normal((t, h)) * rng.choice([1, 30, 1e3], (t, h))).astype(np.float32)
    b = (rng.standard_normal((t, h)) * 20).astype(np.float32)
    for x in (a, b):
        mask = rng.random((t, h)) < 0.25
        x[mask] = rng.choice(SPECIAL, int(mask.sum()))
    return a, b


def composed_gates(a, b, dt, ssm_a):
    return sn.mul(sn.softplus(sn.add(a, dt)), ssm_a).numpy(), sn.sigmoid(b).numpy()


@pytest.mark.parametrize("t", [0, 1, 7])
@pytest.mark.parametrize("vec_shape", ["h", "1h"])
def test_gdn_gates_bitwise(rng, t, vec_shape):
    h = 48
    a, b = gate_inputs(rng, t, h)
    dt = (rng.standard_normal(h) * 5).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(h)).astype(np.float32)
    dt[:3], ssm_a[3:5] = [np.inf, -30, 0], [0, -np.inf]
    if vec_shape == "1h":
        dt, ssm_a = dt.reshape(1, h), ssm_a.reshape(1, h)
    g, beta = sn.gdn_gates(a, b, dt, ssm_a)
    want_g, want_beta = composed_gates(a, b, dt, ssm_a)
    assert_bits(g.numpy(), want_g)
    assert_bits(beta.numpy(), want_beta)
    # the numpy arithmetic the CPU model used: float32 a + dt, then float32 x * ssm_a
    with np.errstate(invalid="ignore"):  # inf + -inf and inf * 0 are NaN on purpose
        sp = sn.softplus(a + dt).numpy()
        assert_bits(g.numpy(), (sp * ssm_a).astype(np.float32))


def test_gdn_gates_strided_rows(rng):
    """a and b may be column slices of a fused projection (row-strided), like the other elementwise ops."""
    ab = (rng.standard_normal((5, 16)) * 30).astype(np.float32)
    a, b = ab[:, :8], ab[:, 8:]
    dt, ssm_a = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    g, beta = sn.gdn_gates(a, b, dt, ssm_a)
    want_g, want_beta = composed_gates(np.ascontiguousarray(a), np.ascontiguousarray(b), dt, ssm_a)
    assert_bits(g.numpy(), want_g)
    assert_bits(beta.numpy(), want_beta)


def test_gdn_gates_bad_inputs():
    f = np.ones((3, 4), np.float32)
    v = np.ones(4, np.float32)
    cases = [
        ((f.astype(np.float16), f, v, v), "a must be F32"),
        ((f, f.astype(np.float16), v, v), "b must be F32"),
        ((f, f, v.astype(np.float16), v), "dt must be F32"),
        ((f, f, v, v.astype(np.float16)), "ssm_a must be F32"),
        ((np.ones(4, np.float32), np.ones(4, np.float32), v, v), "a must have 2 dimensions"),
        ((np.ones((2, 3, 4), np.float32), f, v, v), "a must have 2 dimensions"),
        ((f, np.ones(4, np.float32), v, v), "b must have 2 dimensions"),
        ((f, np.ones((2, 4), np.float32), v, v), "b must have a's shape"),
        ((f, f, np.ones(5, np.float32), v), r"dt must have shape \[H\] or \[1, H\]"),
        ((f, f, np.ones((2, 4), np.float32), v), r"dt must have shape \[H\] or \[1, H\]"),
        ((f, f, np.ones((1, 1, 4), np.float32), v), r"dt must have shape \[H\] or \[1, H\]"),
        ((f, f, v, np.ones((4, 1), np.float32)), r"ssm_a must have shape \[H\] or \[1, H\]"),
        ((f, f, v, np.ones(3, np.float32)), r"ssm_a must have shape \[H\] or \[1, H\]"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            sn.gdn_gates(*args)
