"""The properties torch's own test/nn/test_dropout.py (TestDropoutNN, TestDropoutNNDeviceType)
checks of nn.Dropout, Dropout1d/2d/3d, F.dropout and alpha dropout, stated once for every way
torch_pallas offers dropout and every tensor kind (issue 29).

Not a test module: tests/test_dropout_parity.py (the xla stack: XLA and CPU tensors) and
tests/torchax/test_dropout_parity.py (torchax and CPU tensors) import the ``test_*`` functions
below and define the ``kind`` fixture (a :class:`Kind`) they run on. ``way`` picks how dropout
is called: torch_pallas's module, its function (wrapped as a module with torch's
``(p, inplace)``), torch's module converted by ``convert_dropout``, or torch's module run
inside ``route_dropout`` (its ``F.dropout*`` call routed). Keys come from a ``key_scope``, so
every statistic below is of a fixed mask: what torch checks with its RNG frozen.

Shapes are small and reused (statistics on at most ~10^5 elements) so XLA compiles little.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from torch_pallas import seeds

SEED = 29


@dataclasses.dataclass(frozen=True)
class Kind:
    """A tensor kind: ``to`` makes one from a CPU tensor, ``values`` reads one back as float64
    NumPy. ``layouts``: strides are real (CPU tensors), so layouts are checked as torch's test
    checks them; XLA and torchax tensors report contiguous strides whatever torch would."""
    name: str
    to: Callable[[torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor], np.ndarray]
    layouts: bool
    float64: bool = True


def cpu_kind(**kwargs) -> Kind:
    return Kind("cpu", lambda t: t, lambda t: t.detach().double().numpy(), layouts=True, **kwargs)


FAMILIES = ("", "1d", "2d", "3d")
WAYS = ("module", "function", "converted", "route")


class Functional(torch.nn.Module):
    """torch_pallas.dropout* as a module with torch's ``(p, inplace)``."""

    def __init__(self, function, p=0.5, inplace=False):
        super().__init__()
        self.function, self.p, self.inplace = function, p, inplace

    def forward(self, x):
        return self.function(x, self.p, self.training, self.inplace)


class Routed(torch.nn.Module):
    """torch's own module, run inside route_dropout."""

    def __init__(self, module):
        super().__init__()
        self.inner = module

    def forward(self, x):
        with torch_pallas.route_dropout():
            return self.inner(x)


def make(way: str, family: str, p: float = 0.5, inplace: bool = False) -> torch.nn.Module:
    """A dropout of ``family`` ("", "1d", "2d", "3d") called the ``way`` way."""
    if way == "module":
        return getattr(torch_pallas.nn, f"Dropout{family}")(p, inplace)
    if way == "function":
        return Functional(getattr(torch_pallas, f"dropout{family}"), p, inplace)
    theirs = getattr(torch.nn, f"Dropout{family}")(p, inplace)
    if way == "converted":
        converted = torch_pallas.convert_dropout(theirs)
        assert type(converted) is getattr(torch_pallas.nn, f"Dropout{family}")
        return converted
    return Routed(theirs)


def keyed(seed: int = SEED):
    """Draws without a seed inside it come from ``seed``'s key (torch's freeze_rng_state)."""
    return seeds.key_scope(seeds.key_data_from_seed(seed))


def mean(kind: Kind, tensor) -> float:
    return float(kind.values(tensor).mean())


# TestDropoutNNDeviceType._test_dropout: mean and gradient mean near 1 - p, inplace too; eval
# mode the identity; repr. Inputs per family as torch's (sizes fixed; Dropout1d's larger, for a
# meaningful statistic over its channels).
STAT_SHAPES = {"": (1000,), "1d": (40, 50, 10), "2d": (1000, 2, 3, 2), "3d": (1000, 2, 1, 2, 3)}
STAT_CASES = [("", torch.float32, torch.contiguous_format), ("", torch.bfloat16, torch.contiguous_format),
              ("1d", torch.float64, torch.contiguous_format), ("2d", torch.float32, torch.contiguous_format),
              ("2d", torch.float32, torch.channels_last), ("3d", torch.float32, torch.contiguous_format)]


@pytest.mark.parametrize("family,dtype,memory_format", STAT_CASES,
                         ids=[f"Dropout{f}-{str(d)[6:]}-{str(m)[6:]}" for f, d, m in STAT_CASES])
@pytest.mark.parametrize("way", WAYS)
def test_mean_and_gradient_mean_near_1_minus_p_and_eval_is_the_identity(kind, way, family, dtype, memory_format):
    if dtype == torch.float64 and not kind.float64:
        dtype = torch.float32
    p = 0.2
    input = kind.to(torch.full(STAT_SHAPES[family], 1 - p, dtype=dtype))
    for inplace in (False, True):
        module = make(way, family, p, inplace)
        input_var = input.clone(memory_format=memory_format).requires_grad_()
        with keyed(SEED + inplace):
            output = module(input_var + 0 if inplace else input_var)
        assert output.dtype == dtype and output.shape == input.shape
        if kind.layouts:
            assert output.is_contiguous(memory_format=memory_format)
        assert abs(mean(kind, output) - (1 - p)) < 0.05
        output.backward(input)
        if kind.layouts:
            assert input_var.grad.is_contiguous(memory_format=memory_format)
        assert abs(mean(kind, input_var.grad) - (1 - p)) < 0.05
        # the gradient went through the forward's mask
        np.testing.assert_array_equal(kind.values(input_var.grad) != 0, kind.values(output) != 0)
    for inplace in (True, False):
        module = make(way, family, p, inplace).eval()
        np.testing.assert_array_equal(kind.values(module(input)), kind.values(input))
    repr(module), str(module)


# _test_dropout_discontiguous: p == 0 or almost 0 keeps a strided view's values (and, on
# tensors with strides, the memory format).
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous",
                                                                                               "channels_last"])
@pytest.mark.parametrize("family", ["", "2d", "3d"])
@pytest.mark.parametrize("way", WAYS)
def test_strided_views_are_kept_with_p_close_to_0(kind, way, family, memory_format):
    for p in (0, 1e-10):
        base = torch.empty(2, 3, 3, 6, memory_format=memory_format)
        view = kind.to(base)[..., ::2]
        view.copy_(kind.to(torch.ones(2, 3, 3, 3)))
        with keyed():
            out = make(way, family, p)(view)
        if p and kind.layouts:
            assert out.is_contiguous(memory_format=memory_format)
        np.testing.assert_array_equal(kind.values(out), kind.values(view))


# _test_dropout_stride_mean_preserve: permuted and shifted views of ones keep their mean (and
# on CPU tensors their layout: out.permute(perm) is contiguous); p = 1e-10 keeps the values.
def _invert(perm):
    return tuple(perm.index(i) for i in range(len(perm)))


@pytest.mark.parametrize("way", WAYS)
def test_permuted_and_shifted_inputs_keep_layout_and_mean(kind, way):
    ones = torch.ones(2, 3, 4, 5)
    # Every permutation where strides are real; elsewhere a few (the values are what is checked).
    perms = list(itertools.permutations(range(4))) if kind.layouts else [(0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0)]
    for perm, shift in itertools.product(perms, [(0, 0), (1, 0), (0, 1), (1, 1)]):
        permuted = ones.permute(perm).contiguous().permute(_invert(perm))[shift[0]:, shift[1]:]
        permuted = permuted if kind.layouts else kind.to(permuted.contiguous())
        for p in (1e-10, 0.3, 0.5, 0.7):
            with keyed(SEED + int(p * 10)):
                out = make(way, "", p)(permuted)
            if kind.layouts:
                assert out.permute(perm).is_contiguous(), (perm, shift, p, out.stride())
            assert abs(mean(kind, out) - 1) <= 0.5 + 0.5  # torch's assertEqual(rtol=0.5, atol=0.5)
            same = np.array_equal(kind.values(out), kind.values(permuted))
            assert same if p == 1e-10 else not same


# TestDropoutNN.test_invalid_dropout_p, for every family (torch's modules check p when built;
# F.dropout* when called).
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("way", WAYS)
def test_invalid_p_raises_value_error(kind, way, family):
    v = kind.to(torch.ones(1, 1, 1, 1, 1) if family else torch.ones(1))
    v = v.reshape((1,) * {"": 1, "1d": 3, "2d": 4, "3d": 5}[family])
    for p in (-0.1, 1.1):
        with pytest.raises(ValueError):
            if way == "route":  # torch's module refuses p itself: the routed call is F.dropout*'s
                with torch_pallas.route_dropout():
                    getattr(F, f"dropout{family}")(v, p)
            else:
                make(way, family, p)(v)


# test_Dropout1d: other ranks raise torch's RuntimeError with torch's message (ours is a
# ValueError too, the project's type for bad input).
@pytest.mark.parametrize("way", WAYS)
def test_dropout1d_rank_errors_are_torchs(kind, way):
    for shape, rank in (((1, 2, 2, 2), 4), ((2,), 1)):
        x = kind.to(torch.rand(shape))
        for error in (RuntimeError, ValueError):
            with pytest.raises(error, match=f"Expected 2D or 3D input, but received a {rank}D input"):
                make(way, "1d")(x)
    with pytest.raises(RuntimeError) as ours:
        make(way, "1d")(kind.to(torch.rand(1, 2, 2, 2)))
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.Dropout1d()(torch.rand(1, 2, 2, 2))
    assert str(ours.value) == str(theirs.value)


# test_Dropout2d / test_Dropout3d: other ranks warn with torch's messages (and go on).
RANK_WARNINGS = [("2d", (1, 2, 2, 2, 2), "Received a 5-D input to dropout2d"),
                 ("2d", (1, 2), "Received a 2-D input to dropout2d"),
                 ("2d", (1, 2, 2), "assuming that channel-wise 1D dropout behavior is desired"),
                 ("3d", (1, 2, 2, 2, 2, 2), "Received a 6-D input to dropout3d"),
                 ("3d", (1, 2, 2), "Received a 3-D input to dropout3d")]


@pytest.mark.parametrize("way", WAYS)
def test_dropout2d_and_3d_rank_warnings_are_torchs(kind, way):
    for family, shape, message in RANK_WARNINGS:
        x = torch.rand(shape)
        with pytest.warns(UserWarning) as theirs:
            getattr(F, f"dropout{family}")(x, 0.5)
        with pytest.warns(UserWarning, match=message) as ours:
            with keyed():
                out = make(way, family)(kind.to(x))
        assert out.shape == x.shape
        assert sorted(str(w.message) for w in ours) == sorted(str(w.message) for w in theirs)


# _test_dropoutNd_no_batch: an unbatched input gives what a batch of one gives for the same key.
@pytest.mark.parametrize("family,shape", [("1d", (50, 2)), ("3d", (50, 2, 2, 2))])
@pytest.mark.parametrize("inplace", [False, True], ids=["", "inplace"])
@pytest.mark.parametrize("way", WAYS)
def test_unbatched_input_equals_a_batch_of_one(kind, way, family, shape, inplace):
    input = kind.to(torch.rand(shape, generator=torch.Generator().manual_seed(0)))
    input_clone = input.clone()
    dropout = make(way, family, 0.5, inplace)
    with keyed():
        unbatched = dropout(input)
    with keyed():
        batched = dropout(input_clone.unsqueeze(0)).squeeze(0)
    np.testing.assert_array_equal(kind.values(unbatched), kind.values(batched))
    assert (kind.values(unbatched) == 0).any() and (kind.values(unbatched) != 0).any()


# _test_dropoutNd_channel_zero: a channel of a positive input is all zero or all kept.
@pytest.mark.parametrize("family,shape", [("1d", (10, 4, 2)), ("2d", (10, 4, 2, 2)), ("3d", (10, 4, 2, 2, 2))])
@pytest.mark.parametrize("inplace", [False, True], ids=["", "inplace"])
@pytest.mark.parametrize("way", WAYS)
def test_whole_channels_are_zeroed(kind, way, family, shape, inplace):
    with keyed():
        result = kind.values(make(way, family, 0.5, inplace)(kind.to(torch.ones(shape))))
    per_channel = (result.reshape(shape[0] * shape[1], -1) != 0).sum(axis=1)
    assert set(per_channel.tolist()) == {0, int(np.prod(shape[2:]))}


# test_empty_dropout, for every family (empty batch for the channel ones).
@pytest.mark.parametrize("family,shape", [("", (0,)), ("1d", (0, 3, 4)), ("2d", (0, 3, 2, 2)),
                                          ("3d", (0, 3, 2, 2, 2))])
@pytest.mark.parametrize("way", WAYS)
def test_empty_input(kind, way, family, shape):
    x = kind.to(torch.empty(shape)).requires_grad_()
    out = make(way, family)(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape


# test_native_dropout_corner_case: p in {0, 1}, training on and off: torch's values and gradients
# (torch's own modules on CPU tensors, run when this module is imported: outside torchax's
# environment, which would take torch's dropout over).
CORNER_SHAPES = {"": (5,), "1d": (2, 3, 5), "2d": (2, 3, 2, 2), "3d": (2, 3, 1, 2, 2)}
CORNERS = list(itertools.product((True, False), (0.0, 1.0)))


def _torchs_corners():
    results = {}
    for family, shape in CORNER_SHAPES.items():
        values = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        for train, p in CORNERS:
            x = values.clone().requires_grad_()
            out = getattr(torch.nn, f"Dropout{family}")(p).train(train)(x)
            out.sum().backward()
            results[family, train, p] = values, out.detach().double().numpy(), x.grad.double().numpy()
    return results


TORCHS_CORNERS = _torchs_corners()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("way", WAYS)
def test_p_0_and_1_give_torchs_values_and_gradients(kind, way, family):
    for train, p in CORNERS:
        values, expected, expected_grad = TORCHS_CORNERS[family, train, p]
        x = kind.to(values.clone()).requires_grad_()
        out = make(way, family, p).train(train)(x)
        out.sum().backward()
        np.testing.assert_array_equal(kind.values(out), expected)
        np.testing.assert_array_equal(kind.values(x.grad), expected_grad)


# TestDropoutNN._test_alpha_dropout: alpha dropout keeps the mean and the standard deviation.
# convert_dropout and route_dropout leave it to torch (its semantics are not dropout's).
class AlphaModel(torch.nn.Module):
    def __init__(self, cls, p):
        super().__init__()
        self.alpha = cls(p)
        self.dropout = torch.nn.Dropout(0.5)  # so that convert_dropout converts something


ALPHA_CASES = [(torch.nn.AlphaDropout, (5000,)), (torch.nn.FeatureAlphaDropout, (1000, 2, 1, 2, 3)),
               (torch.nn.FeatureAlphaDropout, (50, 20, 8, 8))]


@pytest.mark.parametrize("cls,shape", ALPHA_CASES, ids=["AlphaDropout", "FeatureAlphaDropout",
                                                        "FeatureAlphaDropout-unbatched"])
@pytest.mark.parametrize("how", ["converted", "routed", "routed-functional"])
def test_alpha_dropout_is_left_to_torch_and_keeps_mean_and_std(kind, how, cls, shape):
    input = kind.to(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    values = kind.values(input)
    for p in (0.2, 0.5, 0.8):
        model = AlphaModel(cls, p)
        if how == "converted":
            torch_pallas.convert_dropout(model)
            assert type(model.alpha) is cls and isinstance(model.dropout, torch_pallas.nn.Dropout)
            context = contextlib.nullcontext()
        else:
            context = torch_pallas.route_dropout()
        input_var = input.detach().clone().requires_grad_()
        with context:
            if how == "routed-functional":
                function = F.alpha_dropout if cls is torch.nn.AlphaDropout else F.feature_alpha_dropout
                output = function(input_var, p, True)
            else:
                output = model.alpha(input_var)
        out = kind.values(output)
        assert abs(out.mean() - values.mean()) < 0.1
        assert abs(out.std(ddof=1) - values.std(ddof=1)) < 0.1
        output.backward(input)
        assert input_var.grad.shape == input.shape


# Not in torch's file: every way above is the same dropout (route_dropout and convert_dropout
# really run torch_pallas's), so each property holds of each.
@pytest.mark.parametrize("family,shape", [("", (4, 6, 5, 7)), ("1d", (4, 6, 5)), ("2d", (4, 6, 5, 7)),
                                          ("3d", (4, 6, 5, 7, 2))])
@pytest.mark.parametrize("way", WAYS[1:])
def test_every_way_draws_the_modules_mask(kind, way, family, shape):
    x = kind.to(torch.rand(shape, generator=torch.Generator().manual_seed(3)) + 0.5)
    with keyed():
        expected = kind.values(make("module", family, 0.3)(x))
    with keyed():
        got = kind.values(make(way, family, 0.3)(x))
    np.testing.assert_array_equal(got, expected)
