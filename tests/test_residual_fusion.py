"""Dropouts fused with what reads them: residual adds into torch_pallas.dropout_add
(route_dropout(fuse_residual=True) on lazy XLA tensors, the "torch_pallas" backend under
torch.compile), eager attention's products into torch_pallas.dropout_matmul and linear layers
into torch_pallas.dropout_linear (route_dropout(fuse_matmul=True)), alone and in transformers
models."""


import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as metrics

import torch_pallas
from conftest import read_together
from kernel_calls import kernel_calls
from torch_pallas import residual_fusion

DEVICE = torch_xla.device()


def kernel_nodes(*tensors, matmul: bool = False, linear: bool = False) -> dict:
    """How many dropout kernels (key, x), fused dropout_add kernels (key, x, residual: the
    output's shape), with ``matmul`` dropout_matmul kernels (key, weights, value: another
    shape) and with ``linear`` dropout_linear kernels (key, x, a 2-D weight) the lazy graph of
    ``tensors`` holds: what would be compiled and run, dead nodes left out. (Attention kernels
    take four operands or more: :func:`attention_nodes`.)"""
    shapes, calls = kernel_calls(*tensors)
    counts = {"dropout": 0, "dropout_add": 0, "dropout_matmul": 0, "dropout_linear": 0}
    for output, operands in calls:
        if len(operands) == 2:
            counts["dropout"] += 1
        elif len(operands) == 3:
            third = shapes.get(operands[2], "")
            rank = third[third.find("[") + 1:third.find("]")].count(",") + 1
            counts["dropout_add" if third == output else "dropout_linear" if rank == 2 else "dropout_matmul"] += 1
    for kind, wanted in (("dropout_matmul", matmul), ("dropout_linear", linear)):
        if not wanted:
            assert counts.pop(kind) == 0, kind
    return counts


def integers(*shape, scale=1.0):
    """Integer-valued floats: x / (1 - p) with p = 0.5 and the sums are exact."""
    return (torch.randint(-8, 8, shape).float() * scale).to(DEVICE)


FORMS = {
    "residual + dropout(x)": lambda x, r, b: r + F.dropout(x, 0.5),
    "dropout(x) + residual": lambda x, r, b: torch.nn.Dropout(0.5)(x) + r,
    "torch.add": lambda x, r, b: torch.add(r, torch.dropout(x, 0.5, True)),
    "dropout(x + bias) + residual": lambda x, r, b: F.dropout(x + b, 0.5) + r,
}


@pytest.mark.parametrize("form", FORMS)
def test_fused_add_has_the_unfused_mask_bits_and_gradients_and_one_kernel(form):
    x, r, b = (integers(16, 128).requires_grad_() for _ in range(3))
    weights = integers(16, 128)
    results = {}
    for fuse in (False, True):
        torch_xla.manual_seed(3)
        with torch_pallas.route_dropout(fuse_residual=fuse):
            out = FORMS[form](x, r, b)
        assert kernel_nodes(out) == {"dropout": int(not fuse), "dropout_add": int(fuse)}
        grads = torch.autograd.grad((out * weights).sum(), (x, r, b), materialize_grads=True)
        results[fuse] = [out, *grads]
    for unfused, fused in zip(*read_together(results[False], results[True])):
        assert torch.equal(unfused, fused)


def test_inplace_adds_write_the_fused_sum_into_the_residual():
    x = integers(8, 128)
    for write in (lambda r, y: r.__iadd__(y), lambda r, y: r.add_(y)):
        r = integers(8, 128)
        expected = r.clone()
        torch_xla.manual_seed(4)
        with torch_pallas.route_dropout():
            expected += F.dropout(x, 0.5)
        torch_xla.manual_seed(4)
        with torch_pallas.route_dropout(fuse_residual=True):
            assert write(r, F.dropout(x, 0.5)) is r
        assert kernel_nodes(r) == {"dropout": 0, "dropout_add": 1} and torch.equal(r.cpu(), expected.cpu())


def test_adds_it_cannot_fuse_are_left_to_torch():
    x, r = integers(8, 128), integers(8, 128)
    cases = [  # (the add, given the dropout's output y and its input), each equal to the unfused add
        lambda y, x: r + y.mul_(2),           # y written in place in between
        lambda y, x: r + (x.add_(1), y)[1],   # the dropout's input written in place
        lambda y, x: torch.add(r, y, alpha=2),
        lambda y, x: r[:1] + y,               # broadcast
        lambda y, x: r.double() + y,          # promotion
    ]
    for add in cases:
        results = []
        for fuse in (False, True):
            torch_xla.manual_seed(5)
            with torch_pallas.route_dropout(fuse_residual=fuse):
                input = x.clone()
                results.append(add(F.dropout(input, 0.5), input))
        assert kernel_nodes(results[1])["dropout_add"] == 0 and torch.equal(results[0].cpu(), results[1].cpu())
    cpu = torch.ones(4, 128)  # eager CPU tensors: the dropout kernel has run already
    with torch_pallas.route_dropout(fuse_residual=True):
        assert not hasattr(F.dropout(cpu, 0.5), residual_fusion._DRAWN)
    for name in ("fuse_residual", "fuse_matmul"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got int 1"):
            torch_pallas.route_dropout(**{name: 1})
    with pytest.raises(TypeError, match="fuse_linear must be True, False or None, got int 1"):
        torch_pallas.route_dropout(fuse_linear=1)


def test_compiled_backend_fuses_fullgraph_with_the_unfused_numbers_and_compiles_once(monkeypatch):
    fused_per_graph = []
    fuse = residual_fusion.fuse_residual_dropouts
    monkeypatch.setattr(residual_fusion, "fuse_residual_dropouts",
                        lambda graph: fused_per_graph.append(fuse(graph)) or fused_per_graph[-1])

    def step(x, r, b):
        with torch_pallas.route_dropout():
            hidden = r + F.dropout(x + b, 0.5)
            hidden += F.dropout(hidden, 0.5)  # in place, on a tensor of the graph
        return hidden

    x, r, b = (integers(16, 128).requires_grad_() for _ in range(3))
    results, compiles = {}, []
    for backend in ("openxla", residual_fusion.BACKEND):
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        for _ in range(2):
            torch_xla.manual_seed(6)
            out = compiled(x, r, b)
            grads = torch.autograd.grad(out.sum(), (x, r, b))
            torch_xla.sync()
            compiles.append(metrics.metric_data("CompileTime")[0])
        results[backend] = [out, *grads]
    # Forward, then backward: hidden's gradient is its own plus the second dropout's (a sum fused too).
    assert fused_per_graph == [2, 1], fused_per_graph  # and graphs compiled once
    assert compiles[2] == compiles[3], compiles  # the second call compiles nothing
    for unfused, fused in zip(*results.values()):
        assert torch.equal(unfused.cpu(), fused.cpu())


def test_checkpointed_region_fuses_in_the_forward_and_the_recomputation():
    results = []
    for fuse in (False, True):
        torch.manual_seed(0)
        x, r = integers(8, 128).requires_grad_(), integers(8, 128).requires_grad_()
        torch_xla.manual_seed(7)
        with torch_pallas.route_dropout(fuse_residual=fuse):
            out = torch_pallas.checkpoint(lambda x, r: r + F.dropout(x, 0.5), x, r, use_reentrant=True)
        (out * out).sum().backward()  # the recomputation's mask: out's gradient flows through it
        results.append([out, x.grad, r.grad])
    for unfused, fused in zip(*read_together(*results)):
        assert torch.equal(unfused, fused)


MATMUL_FORMS = {
    "dropout(w) @ v": lambda w, v: F.dropout(w, 0.5) @ v,
    "torch.matmul": lambda w, v: torch.matmul(torch.nn.Dropout(0.5)(w), v),
    "Tensor.matmul": lambda w, v: torch.dropout(w, 0.5, True).matmul(v),
}


# Weights and values: planes, and short planes whose heads fill whole lane columns (heads in lanes).
PRODUCT_SHAPES = {"planes": ((2, 3, 16, 256), 8), "heads-in-lanes": ((2, 4, 16, 128), 32)}


@pytest.mark.parametrize("shape", PRODUCT_SHAPES)
@pytest.mark.parametrize("form", MATMUL_FORMS)
def test_fused_matmul_has_the_unfused_mask_values_and_gradients_and_one_kernel(form, shape):
    (*batch, L, S), Ev = PRODUCT_SHAPES[shape]
    w, v = integers(*batch, L, S).requires_grad_(), integers(*batch, S, Ev).requires_grad_()
    weights = integers(*batch, L, Ev)
    results = {}
    for fuse in (False, True):
        torch_xla.manual_seed(3)
        with torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse):  # the unfused mask
            out = MATMUL_FORMS[form](w, v)
        assert kernel_nodes(out, matmul=True) == {"dropout": int(not fuse), "dropout_add": 0,
                                                  "dropout_matmul": int(fuse)}
        results[fuse] = [out, *torch.autograd.grad((out * weights).sum(), (w, v))]
    for unfused, fused in zip(*read_together(results[False], results[True])):
        assert torch.equal(unfused, fused)  # integers: every sum exact


# A linear layer after its input's dropout (LoRA's lora_A(dropout(x)), T5's wo(dropout(h))): an
# nn.Dropout routed as F.dropout, or converted to torch_pallas.nn.Dropout.
LINEAR_DROPOUTS = {"routed": lambda: torch.nn.Dropout(0.5), "converted": lambda: torch_pallas.nn.Dropout(0.5)}


@pytest.mark.parametrize("dropout", LINEAR_DROPOUTS)
def test_linear_of_a_dropout_is_one_kernel_with_its_mask_values_and_gradients(dropout):
    """route_dropout's defaults (impl tiled, fuse_linear on): the fused kernel draws the
    dropout's own mask."""
    x, weights = integers(2, 16, 256).requires_grad_(), integers(2, 16, 16)
    linear = torch.nn.Linear(256, 16).to(DEVICE)
    with torch.no_grad():
        linear.weight.copy_(integers(16, 256))
        linear.bias.copy_(integers(16))
    results = {}
    for fuse in (False, True):
        torch_xla.manual_seed(3)
        with torch_pallas.route_dropout() if fuse else torch_pallas.route_dropout(fuse_linear=False):
            out = linear(LINEAR_DROPOUTS[dropout]()(x))
        _, calls = kernel_calls(out)
        # Fused: one kernel reading (key, x, weight), the dropout's own kernel dead.
        assert [len(operands) for _, operands in calls] == [3 if fuse else 2]
        results[fuse] = [out, *torch.autograd.grad((out * weights).sum(), (x, linear.weight, linear.bias))]
    for unfused, fused in zip(*read_together(results[False], results[True])):
        assert torch.equal(unfused, fused)  # integers: every sum exact
    with torch_pallas.route_dropout():  # eager CPU tensors: nothing to fuse, nothing remembered
        assert not hasattr(LINEAR_DROPOUTS[dropout]()(x.cpu()), residual_fusion._DRAWN)


def test_route_dropouts_default_fuses_skinny_linear_layers_only():
    """fuse_linear=None fuses a weight of at most 128 output features (LoRA's ranks), not a wider one
    (T5's wo: slower fused); True fuses both."""
    x = integers(2, 16, 256)
    for features, route, fused in ((128, {}, True), (256, {}, False), (256, {"fuse_linear": True}, True)):
        weight = integers(features, 256)
        with torch_pallas.route_dropout(**route):
            out = F.linear(F.dropout(x, 0.5), weight)
        assert kernel_nodes(out, linear=True)["dropout_linear"] == int(fused), (features, route)


SOFTMAX_FORMS = {
    "F.softmax": lambda s: F.softmax(s, dim=-1),
    "torch.softmax": lambda s: torch.softmax(s, 3),
    "Tensor.softmax": lambda s: s.softmax(-1),
}


def has_softmax(*tensors) -> bool:
    return "softmax" in torch_xla._XLAC._get_xla_tensors_text(list(tensors))


@pytest.mark.parametrize("shape", PRODUCT_SHAPES)
@pytest.mark.parametrize("form", SOFTMAX_FORMS)
def test_softmax_dropout_and_matmul_are_one_kernel_with_the_unfused_mask(form, shape):
    """The softmax joins the kernel: no softmax left in the lazy graph, values and gradients
    within float32 rounding of the unfused ones (the kernel's softmax rounds its own way)."""
    (*batch, L, S), Ev = PRODUCT_SHAPES[shape]
    torch.manual_seed(0)
    s = (torch.randn(*batch, L, S) * 3).to(DEVICE).requires_grad_()
    v = integers(*batch, S, Ev).requires_grad_()
    weights = integers(*batch, L, Ev)
    results = {}
    for fuse in (False, True):
        torch_xla.manual_seed(3)
        with torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse):  # the unfused mask
            out = F.dropout(SOFTMAX_FORMS[form](s), 0.5) @ v
        assert kernel_nodes(out, matmul=True) == {"dropout": int(not fuse), "dropout_add": 0,
                                                  "dropout_matmul": int(fuse)}
        assert has_softmax(out) != fuse
        if form != "F.softmax":
            continue  # one form runs: the others are the same kernel
        results[fuse] = [out, *torch.autograd.grad((out * weights).sum(), (s, v))]
    for unfused, fused in zip(*read_together(results.get(False, []), results.get(True, []))):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_a_softmax_it_cannot_take_is_left_before_the_fused_product():
    s, v = integers(2, 16, 256), integers(2, 256, 8)
    # another dtype (converted back: still attention weights), written in place
    for softmax in (lambda s: F.softmax(s, dim=-1, dtype=torch.float64).float(), lambda s: F.softmax(s, dim=-1).mul_(1)):
        with torch_pallas.route_dropout():
            out = F.dropout(softmax(s), 0.5) @ v
        assert kernel_nodes(out, matmul=True)["dropout_matmul"] == 1 and has_softmax(out)
    # A softmax over another dim is not attention weights: with a per-tile impl its dropout draws
    # dropout's mask, not the fused kernel's, and the product is torch's; threefry's is one mask.
    for impl, fused in (("tiled", 0), ("threefry", 1)):
        with torch_pallas.route_dropout(impl=impl):
            out = F.dropout(F.softmax(s, dim=1), 0.5) @ v
        assert kernel_nodes(out, matmul=True)["dropout_matmul"] == fused and has_softmax(out)
    long_rows, long_value = integers(1, 8, 16385), integers(1, 16385, 8)  # a block of 8 whole rows would not fit VMEM
    with torch_pallas.route_dropout(fuse_matmul=True):
        out = F.dropout(F.softmax(long_rows, dim=-1), 0.5) @ long_value
    assert kernel_nodes(out, matmul=True)["dropout_matmul"] == 1 and has_softmax(out)


def test_products_it_cannot_fuse_are_left_to_torch():
    w, v = integers(2, 3, 16, 256), integers(2, 3, 256, 8)
    cases = [  # (the product, given the dropout's output y and its input), each equal to the unfused one
        lambda y, w: y @ v[0],                 # a broadcast value
        lambda y, w: y @ v.double(),           # promotion
        lambda y, w: v.transpose(-2, -1) @ y.transpose(-2, -1)[..., :16],  # the dropout on the right
        lambda y, w: y.mul_(2) @ v,            # y written in place in between
        lambda y, w: (w.add_(1), y)[1] @ v,    # the dropout's input written in place
    ]
    for product in cases:
        results = []
        for fuse in (False, True):
            torch_xla.manual_seed(5)
            fresh = w.clone()
            with torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse):  # the unfused mask
                out = product(F.dropout(fresh, 0.5), fresh)
            assert kernel_nodes(out, matmul=True)["dropout_matmul"] == 0
            results.append(out.cpu())
        assert torch.equal(*results)
    with torch_pallas.route_dropout(fuse_matmul=True):
        eager_cpu = F.dropout(w.cpu(), 0.5) @ v.cpu()  # ran already: nothing to fuse
    assert eager_cpu.shape == (2, 3, 16, 8)


def attention_nodes(*tensors) -> int:
    """How many attention kernels (key, query, key, value, and a mask) the lazy graph of
    ``tensors`` holds, dead nodes left out."""
    return sum(len(operands) >= 4 for _, operands in kernel_calls(*tensors)[1])


# Eager attention's scores from query, key and an additive mask, as models write them.
SCORES_FORMS = {
    "q @ k.T / c + mask (BERT)": lambda q, k, m: torch.matmul(q, k.transpose(-1, -2)) / 8.0 + m,
    # the mask first; its first 4 keys padding, so that some queries see no key
    "mask + where(causal, q @ k.T / full(c), full(min)) (GPT-2, padded)": lambda q, k, m: m.masked_fill(
        torch.arange(k.shape[-2]).to(DEVICE) < 4, torch.finfo(q.dtype).min) + torch.where(
            causal(q, k), torch.matmul(q, k.transpose(-1, -2)) / torch.full([], 8.0, device=DEVICE),
            torch.full([], torch.finfo(q.dtype).min, device=DEVICE)),
    # ViT's scaling, then a selection with no mask added after it
    "(q @ k.T * c).masked_fill(~causal, min)": lambda q, k, m: (torch.matmul(q, k.transpose(2, 3)) * 0.125).masked_fill(
        ~causal(q, k), torch.finfo(q.dtype).min),
}


def causal(q, k):
    """Which keys each query sees, causally: key blocks of the longer keys that no query sees."""
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().to(DEVICE)


# (batch, L, S, E): flash planes, and heads that fill whole lane columns (heads in lanes).
ATTENTION_SHAPES = {"planes": ((2, 3), 16, 256, 32), "heads-in-lanes": ((2, 4), 16, 128, 32)}


def eager_attention(scores_form, q, k, v, mask):
    return F.dropout(F.softmax(SCORES_FORMS[scores_form](q, k, mask), dim=-1), 0.5) @ v


def routed_eager_attention(form, shape, impl, routes):
    """Per route (``"attention"``: as models write it; ``"dropout_matmul"``: the key written in
    place first, so that the scores are no remembered product; ``"unfused"``) the output of
    :func:`eager_attention` and the gradients of its leaves (the additive mask's too, where the
    form reads one)."""
    batch, L, S, E = ATTENTION_SHAPES[shape]
    torch.manual_seed(0)
    q, k, v = (torch.randn(*batch, n, E).to(DEVICE).requires_grad_() for n in (L, S, S))
    mask = (torch.randn(batch[0], 1, 1, S) * 2).to(DEVICE).requires_grad_()
    leaves = (q, k, v, mask)
    results = {}
    for route in routes:
        torch_xla.manual_seed(3)
        with torch_pallas.route_dropout(fuse_matmul=route != "unfused", impl=impl):
            key = k.clone().add_(0) if route == "dropout_matmul" else k
            out = eager_attention(form, q, key, v, mask)
        if route == "attention":  # one kernel: no scores, softmax or product left in the lazy graph
            assert attention_nodes(out) == 1 and not has_softmax(out)
            assert kernel_nodes(out, matmul=True) == {"dropout": 0, "dropout_add": 0, "dropout_matmul": 0}
        grads = torch.autograd.grad(out.square().sum(), leaves, allow_unused=True)  # the forms without a mask
        results[route] = [out, *(grad for grad in grads if grad is not None)]
    return results


def assert_within_float32_rounding(results, reference):
    for expected, fused in zip(*read_together(results[reference], results["attention"])):
        torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", SCORES_FORMS)
def test_eager_attention_of_query_and_key_runs_as_one_attention_with_the_fused_products_mask(form):
    """With the scores a remembered q @ k.T (scaled, masked), the whole eager attention is one
    attention kernel with the mask dropout_matmul draws for the weights (tiled: per attention
    tile), values and gradients within float32 rounding (the softmax's rounding, amplified)."""
    assert_within_float32_rounding(routed_eager_attention(form, "planes", "tiled", ("attention", "dropout_matmul")),
                                   "dropout_matmul")


def test_eager_attention_in_lanes_with_threefry_has_the_unfused_dropouts_mask():
    results = routed_eager_attention("q @ k.T / c + mask (BERT)", "heads-in-lanes", "threefry",
                                     ("attention", "unfused"))
    assert_within_float32_rounding(results, "unfused")


def test_scores_it_cannot_take_are_left_to_the_fused_product():
    """Scores other than q @ k.T, one scaling by a number, one selection with the dtype's
    lowest number, then one added mask of the scores' dtype: the softmax, dropout and product
    are dropout_matmul's, as before."""
    q, k, v = integers(2, 3, 16, 32), integers(2, 3, 24, 32), integers(2, 3, 24, 8)
    mask = integers(2, 1, 1, 24)
    eight, keep, lowest = torch.full([], 8.0, device=DEVICE), causal(q, k), torch.finfo(torch.float32).min
    cases = {
        "a tensor's scale made before the scope": lambda: torch.matmul(q, k.transpose(-1, -2)) / eight,
        "a fill above the dtype's lowest": lambda: torch.where(keep, q @ k.transpose(-1, -2), -1e4),
        "a fill of -inf (torch's NaN where a query sees no key)": lambda: (q @ k.transpose(-1, -2)).masked_fill(
            ~keep, float("-inf")),
        "a selection after the mask": lambda: torch.where(keep, q @ k.transpose(-1, -2) + mask, lowest),
        "masked, then scaled": lambda: (q @ k.transpose(-1, -2) + mask) / 8.0,
        "masked in place (T5's)": lambda: (q @ k.transpose(-1, -2)).add_(mask),
        "two masks": lambda: q @ k.transpose(-1, -2) + mask + mask,
        "a key broadcast over the batch": lambda: q @ k[:1].transpose(-1, -2),
        "a mask that widens the scores": lambda: q[:, :, :1] @ k.transpose(-1, -2) + integers(2, 3, 16, 24),
        "a query written in place since": lambda: (lambda s: (q.add_(0), s)[1])(q @ k.transpose(-1, -2)),
        "another dtype's mask": lambda: q @ k.transpose(-1, -2) + mask.bfloat16(),
    }
    for name, scores in cases.items():
        with torch_pallas.route_dropout(fuse_matmul=True):
            out = F.dropout(F.softmax(scores(), dim=-1), 0.5) @ v
        assert attention_nodes(out) == 0, name
        assert kernel_nodes(out, matmul=True)["dropout_matmul"] == 1, name


@pytest.mark.parametrize("shape", PRODUCT_SHAPES)
def test_fused_matmul_under_torch_func_grad_and_checkpointing(shape):
    (*batch, L, S), Ev = PRODUCT_SHAPES[shape]
    w, v = integers(*batch, L, S), integers(*batch, S, Ev)
    results = []
    for fuse in (False, True):
        torch_xla.manual_seed(6)
        with torch_pallas.route_dropout(impl="threefry", fuse_matmul=fuse):  # the unfused mask
            grads = torch.func.grad(lambda w, v: (F.dropout(w, 0.5) @ v).square().sum(), argnums=(0, 1))(w, v)
            w_grad, v_grad = (t.detach().requires_grad_() for t in (w, v))
            out = torch_pallas.checkpoint(lambda w, v: F.dropout(w, 0.5) @ v, w_grad, v_grad)
        out.square().sum().backward()
        results.append([*grads, out, w_grad.grad, v_grad.grad])
    for unfused, fused in zip(*read_together(*results)):
        assert torch.equal(unfused, fused)


try:
    import transformers
except ImportError:  # the tests above need no transformers
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="the test extra installs transformers: "
                                        "pip install -e '.[test]'")


def gpt2(**options):
    config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2, use_cache=False,
                                     **options)
    return transformers.GPT2Model(config), {"input_ids": torch.randint(0, 128, (2, 16))}


def bert(**options):
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=16, **options)
    return transformers.BertModel(config), {"input_ids": torch.randint(0, 128, (2, 16))}


def vit(**options):
    config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=128, hidden_dropout_prob=0.1,
                                    attention_probs_dropout_prob=0.1, **options)
    return transformers.ViTModel(config), {"pixel_values": torch.randn(2, 3, 16, 16)}


def t5(**options):
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
                                   use_cache=False, **options)
    return transformers.T5EncoderModel(config), {"input_ids": torch.randint(0, 128, (2, 16))}


# Per model: (residual dropouts fused, dropouts left standalone: the embeddings'; T5's also
# its eager attention's, its MLPs' inner ones and its final one, which no add follows).
# GPT-2's, BERT's and ViT's attention dropout is in the flash kernel (sdpa).
FUSED_AND_STANDALONE = {gpt2: (4, 1), bert: (4, 1), vit: (4, 1), t5: (4, 6)}


@needs_transformers
@pytest.mark.parametrize("make_model", FUSED_AND_STANDALONE, ids=lambda make: make.__name__)
def test_transformers_models_residual_dropouts_are_fused(make_model):
    torch.manual_seed(0)
    model, inputs = make_model()
    model = model.to(DEVICE).train()
    inputs = {name: value.to(DEVICE) for name, value in inputs.items()}
    with torch_pallas.route_dropout(fuse_matmul=False):  # T5's eager attention unfused
        hidden = model(**inputs).last_hidden_state
    fused, standalone = FUSED_AND_STANDALONE[make_model]
    # T5's feed-forward wo(dropout(relu(wi(h)))), here of 64 output features: one dropout_linear kernel per
    # layer (fuse_linear's default takes at most 128; T5-base's 768 stay unfused).
    linears = 2 if make_model is t5 else 0
    assert kernel_nodes(hidden, linear=True) == {"dropout": standalone - linears, "dropout_add": fused,
                                                 "dropout_linear": linears}


@needs_transformers
@pytest.mark.parametrize("make_model", FUSED_AND_STANDALONE, ids=lambda make: make.__name__)
def test_transformers_models_eager_attention_dropouts_are_fused_with_their_matmul(make_model):
    """With eager attention every layer's softmax, dropout of its attention weights and product
    with the values are one kernel (T5's too), and T5's feed-forward dropout and wo another; the
    other dropouts are as with sdpa. BERT's,
    ViT's and GPT-2's scores are q @ k.T scaled by a number (GPT-2's a 0-dim torch.full),
    masked after (GPT-2: a causal selection, then the additive mask): their whole attention is
    one attention kernel. T5 adds its position bias in place: dropout_matmul takes its scores."""
    torch.manual_seed(0)
    model, inputs = make_model(attn_implementation="eager")
    model = model.to(DEVICE).train()
    inputs = {name: value.to(DEVICE) for name, value in inputs.items()}
    with torch_pallas.route_dropout():  # the defaults: what the README's one line gives
        hidden = model(**inputs).last_hidden_state
    fused, standalone = FUSED_AND_STANDALONE[make_model]
    layers = 2
    whole = make_model is not t5
    # T5's feed-forward wo(dropout(relu(wi(h)))) is one dropout_linear kernel per layer too.
    t5_linears = 0 if whole else layers
    assert kernel_nodes(hidden, matmul=True, linear=True) == {
        "dropout": standalone - (0 if whole else layers) - t5_linears, "dropout_add": fused,
        "dropout_matmul": 0 if whole else layers, "dropout_linear": t5_linears}
    assert attention_nodes(hidden) == (layers if whole else 0)
    assert not has_softmax(hidden)  # each layer's softmax is in its kernel too


# (ViT's, whose eager attention is GPT-2's function, eager_attention_forward: 8 s, in the slow tier)
@needs_transformers
@pytest.mark.parametrize("make_model", [pytest.param(make, marks=pytest.mark.slow if make is vit else ())
                                        for make in FUSED_AND_STANDALONE], ids=lambda make: make.__name__)
def test_attention_weights_read_elsewhere_hold_the_fused_kernels_mask(make_model):
    """``output_attentions=True`` returns each layer's dropped attention weights beside its output:
    with the attention fused (the defaults) they hold the mask the fused kernel drew, so the
    outputs and the weights equal those of the unfused attention (``fuse_matmul=False``: the
    weights dropped by their own kernel, then torch's product) for the same XLA seed."""
    torch.manual_seed(0)
    model, inputs = make_model(attn_implementation="eager")
    model = model.to(DEVICE).train()
    inputs = {name: value.to(DEVICE) for name, value in inputs.items()}
    results = []
    for fuse_matmul in (True, False):
        torch_xla.manual_seed(4)
        with torch_pallas.route_dropout(fuse_matmul=fuse_matmul):
            out = model(**inputs, output_attentions=True)
        # fused: each layer's product is the fused kernel's (not the dropped weights' matmul)
        fused_products = attention_nodes(out.last_hidden_state) + kernel_nodes(
            out.last_hidden_state, matmul=True, linear=True)["dropout_matmul"]
        assert fused_products == (2 if fuse_matmul else 0)
        results.append([out.last_hidden_state, *out.attentions])
    (fused, *fused_weights), (unfused, *unfused_weights) = read_together(*results)
    for got, want in zip(fused_weights, unfused_weights):
        # (the softmax before them is XLA's in both, compiled into other graphs: to float32 rounding)
        assert torch.equal(got == 0, want == 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


@needs_transformers
def test_gpt2_trains_with_its_dropouts_fused_on_eager_attention_as_on_sdpa():
    """Both attentions run as one attention kernel per layer with the same keys: eager's
    causal selection and additive mask give sdpa's losses to float32 rounding."""
    losses = {}
    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        torch_xla.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                         use_cache=False, attn_implementation=attention)
        model = transformers.GPT2LMHeadModel(config).to(DEVICE).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        ids = torch.randint(0, 128, (2, 16)).to(DEVICE)
        losses[attention] = []
        for _ in range(4):
            with torch_pallas.route_dropout(fuse_residual=True, fuse_matmul=True):
                loss = model(input_ids=ids, labels=ids).loss
            assert kernel_nodes(loss, matmul=True) == {"dropout": 1, "dropout_add": 4, "dropout_matmul": 0}
            assert attention_nodes(loss) == 2
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses[attention].append(loss.item())
    assert losses["sdpa"][-1] < losses["sdpa"][0] - 0.3, losses
    torch.testing.assert_close(losses["eager"], losses["sdpa"], rtol=1e-4, atol=0)
