"""argmax and topk against numpy references: exact results, ties to the lower index, NaN above all."""
import numpy as np
import pytest

import specd.native as sn


def rank_key(v, j):
    """Sort key, best first: NaN above every number, then higher value, then lower index."""
    return (0, 0.0, j) if np.isnan(v) else (1, -float(v), j)


def topk_ref(x, k):
    idx = np.array([sorted(range(x.shape[1]), key=lambda j: rank_key(row[j], j))[:k] for row in x], np.int32)
    return np.take_along_axis(x, idx, axis=1), idx


@pytest.mark.parametrize("n,V", [(1, 1), (3, 7), (5, 1000), (1, 100003), (33, 517)])
def test_argmax(rng, n, V):
    x = rng.standard_normal((n, V)).astype(np.float32)
    np.testing.assert_array_equal(sn.argmax(x).numpy(), np.argmax(x, axis=1).astype(np.int32))


def test_argmax_ties_first_index(rng):
    x = rng.integers(0, 3, (6, 40)).astype(np.float32)  # many ties at the maximum
    x[5] = 0.0
    x[4, 17] = -0.0
    x[4, 3] = 5.0
    x[4, 30] = 5.0
    got = sn.argmax(x).numpy()
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    assert got[5] == 0 and got[4] == 3


def test_argmax_ties_across_column_spans():
    # One row of a large vocabulary is split over threads in 16384-column spans; the first maximum
    # must still win when an equal maximum sits in an earlier span.
    x = np.zeros((1, 248320), np.float32)
    x[0, 200000] = 7.0
    x[0, 70000] = 7.0
    x[0, 70001] = 7.0
    assert sn.argmax(x).numpy()[0] == 70000
    x[0, 5] = 7.0
    assert sn.argmax(x).numpy()[0] == 5


def test_argmax_nan_and_inf():
    nan, inf = np.nan, np.inf
    x = np.array([[1, nan, 3, nan], [-inf, -inf, -inf, -inf], [inf, 2, inf, nan], [0, 1, inf, 2]], np.float32)
    got = sn.argmax(x).numpy()
    np.testing.assert_array_equal(got, [1, 0, 3, 2])
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))  # numpy's NaN rule


@pytest.mark.parametrize("n,V,k", [(1, 1, 1), (4, 50, 1), (4, 50, 7), (3, 64, 64), (2, 1000, 40)])
def test_topk(rng, n, V, k):
    x = rng.standard_normal((n, V)).astype(np.float32)
    vals, idx = sn.topk(x, k)
    rv, ri = topk_ref(x, k)
    np.testing.assert_array_equal(idx.numpy(), ri)
    np.testing.assert_array_equal(vals.numpy(), rv)
    if k == 1:
        np.testing.assert_array_equal(idx.numpy()[:, 0], sn.argmax(x).numpy())


@pytest.mark.parametrize("k", [1, 5, 13, 30])
def test_topk_ties_lower_index_first(rng, k):
    x = rng.integers(-2, 3, (5, 30)).astype(np.float32)  # five levels: heavy ties
    x[0] = 1.0
    x[1, ::2] = -0.0
    vals, idx = sn.topk(x, k)
    rv, ri = topk_ref(x, k)
    np.testing.assert_array_equal(idx.numpy(), ri)
    np.testing.assert_array_equal(vals.numpy(), rv)
    assert list(idx.numpy()[0]) == list(range(k))


def test_leading_dimensions(rng):
    x = rng.standard_normal((2, 3, 257)).astype(np.float32)
    got = sn.argmax(x).numpy()
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert int(sn.argmax(x[0, 0]).numpy()) == np.argmax(x[0, 0])  # 1-D -> 0-d
    vals, idx = sn.topk(x, 4)
    assert vals.shape == (2, 3, 4)
    rv, ri = topk_ref(x.reshape(6, 257), 4)
    np.testing.assert_array_equal(idx.numpy().reshape(6, 4), ri)
    np.testing.assert_array_equal(vals.numpy().reshape(6, 4), rv)


def test_topk_nan_and_k_equals_v():
    x = np.array([[0.5, np.nan, -np.inf, 2.0, np.nan, 2.0]], np.float32)
    vals, idx = sn.topk(x, 6)
    np.testing.assert_array_equal(idx.numpy()[0], [1, 4, 3, 5, 0, 2])
    np.testing.assert_array_equal(vals.numpy()[0], x[0, [1, 4, 3, 5, 0, 2]])


def test_topk_strided_rows(rng):
    big = rng.standard_normal((4, 300)).astype(np.float32)
    x = big[:, 100:250]
    vals, idx = sn.topk(x, 9)
    rv, ri = topk_ref(x, 9)
    np.testing.assert_array_equal(idx.numpy(), ri)
    np.testing.assert_array_equal(sn.argmax(x).numpy(), np.argmax(x, axis=1))


def test_bad_input():
    x = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=5\], got 6"):
        sn.topk(x, 6)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=5\], got 0"):
        sn.topk(x, 0)
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        sn.argmax(np.zeros((), np.float32))
    with pytest.raises(ValueError, match="at least one column"):
        sn.argmax(np.zeros((2, 0), np.float32))
    with pytest.raises(ValueError, match="x must be F32"):
        sn.topk(np.zeros((2, 5), np.int32), 1)
