"""Tests for ``tw.discover``: specs found without running a training step.

Ground truth for every shape/dtype is a real forward pass run here in the test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tensorwire.discovery import METHODS, Plan, discover, discover_call
from tensorwire.errors import ConfigError, NotFoundError, ShapeMismatchError, SpecError, TensorWireError
from tensorwire.spec import TensorSpec


# ---------------------------------------------------------------------------
# helpers and modules
# ---------------------------------------------------------------------------
def real_outputs(module, *args, **kwargs):
    """The tensor leaves of a real forward (ground truth)."""
    with torch.no_grad():
        out = module(*args, **kwargs)
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def assert_matches(spec: TensorSpec, tensor: torch.Tensor) -> None:
    assert spec.shape == tuple(tensor.shape), spec
    assert spec.dtype == str(tensor.dtype).removeprefix("torch."), spec
    assert spec.device == tensor.device.type
    spec.check_tensor(tensor)


def snapshot(module):
    return {
        "params": {n: (p, p.detach().clone(), p.requires_grad) for n, p in module.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()},
        "grad_objs": {n: p.grad for n, p in module.named_parameters()},
        "buffers": {n: (b, b.clone()) for n, b in module.named_buffers()},
        "training": [m.training for m in module.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_untouched(module, snap) -> None:
    for n, p in module.named_parameters():
        obj, value, req = snap["params"][n]
        assert p is obj and isinstance(p, nn.Parameter), n
        assert p.requires_grad == req, n
        assert torch.equal(p.detach(), value), n
        before = snap["grads"][n]
        if before is None:
            assert p.grad is None, f"{n}.grad was created"
        else:
            assert p.grad is snap["grad_objs"][n] and torch.equal(p.grad, before), f"{n}.grad changed"
    for n, b in module.named_buffers():
        obj, value = snap["buffers"][n]
        assert b is obj and torch.equal(b, value), f"buffer {n} changed"
    assert [m.training for m in module.modules()] == snap["training"]
    assert torch.equal(torch.get_rng_state(), snap["rng"]), "global RNG state was consumed"


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 10)
    )


class KwargsTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, *, mask=None, scale=1.0):
        h = self.proj(x) * scale
        if mask is not None:
            h = h * mask
        logits = self.head(h)
        return h, {"logits": logits, "pred": logits.argmax(-1), "count": 3}


class EmbeddingStage(nn.Module):
    def __init__(self, vocab=100, dim=24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens):
        return self.norm(self.emb(tokens))


class DataDependent(nn.Module):
    """Python control flow on tensor values: no tracer can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return torch.relu(self.b(x))


class Cfg:  # not a pytree: torch.export rejects it as an input
    def __init__(self, width: int) -> None:
        self.width = width


class WithConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x, cfg):
        return self.lin(x)[..., : cfg.width]


class NeedsStorage(nn.Module):
    """Reads the data pointer (like an alignment check before a kernel): fake tensors and fx cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x):
        if x.data_ptr() % 16 != 0:
            x = x.clone()
        return self.lin(x)


# ---------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------
def test_mlp_stage_static() -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(8, 16)
    plan = discover(model, x)

    assert isinstance(plan, Plan)
    assert plan.method == "export" and plan.attempts == ()
    assert [s.name for s in plan.inputs] == ["input.0"]
    assert_matches(plan["input.0"], x)
    (y,) = real_outputs(model, x)
    assert [s.name for s in plan.outputs] == ["output.0"]
    assert_matches(plan["output.0"], y)
    assert plan["output.0"].shape == (8, 10) and not plan["output.0"].is_dynamic
    assert [s.name for s in plan.grads_of_inputs] == ["grad.input.0"]
    assert plan["grad.input.0"].shape == (8, 16)
    assert [s.name for s in plan.grads_of_outputs] == ["grad.output.0"]
    assert plan["grad.output.0"].shape == (8, 10)

    names = [n for n, _ in model.named_parameters()]
    assert [s.name for s in plan.params] == [f"param.{n}" for n in names]
    assert [s.name for s in plan.grads_of_params] == [f"grad.param.{n}" for n in names]
    for n, p in model.named_parameters():
        assert_matches(plan[f"param.{n}"], p.detach())
        assert plan[f"grad.param.{n}"].shape == tuple(p.shape)
    assert plan["param.0.weight"].shape == (64, 16)
    assert plan.buffers == []

    n_params = sum(p.numel() for p in model.parameters())
    by_group = plan.nbytes_by_group
    assert by_group["params"] == by_group["grads_of_params"] == 4 * n_params
    assert by_group["inputs"] == x.numel() * 4 and by_group["outputs"] == y.numel() * 4
    assert plan.nbytes == by_group["total"] == sum(s.nbytes for s in plan.all.values())
    assert len(plan) == 4 + 2 * len(names)

    table = str(plan)
    assert "export" in table and "param.6.bias" in table and "grad.output.0" in table and "[8, 10]" in table


def test_transformer_block_dynamic_batch() -> None:
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    x = torch.randn(6, 10, 32)
    plan = discover(block, x, dynamic={"batch": 0})

    assert plan.method == "export"
    assert plan["input.0"].shape == (6, 10, 32)
    assert plan["input.0"].dynamic == (True, False, False)
    (y,) = real_outputs(block, x)
    assert_matches(plan["output.0"], y)
    # the output's batch dim follows the input's: dynamic too, and so are both grads
    assert plan["output.0"].dynamic == (True, False, False)
    assert plan["grad.output.0"].dynamic == (True, False, False)
    assert plan["grad.input.0"] == plan["input.0"].with_name("grad.input.0")
    assert plan["input.0"].describe() == "float32[<=6, 10, 32] on cpu"

    # a smaller batch fits everywhere, a larger one is rejected
    small = torch.randn(3, 10, 32)
    plan.check("input.0", small)
    (y_small,) = real_outputs(block, small)
    plan.check("output.0", y_small)
    plan.check("grad.output.0", torch.zeros_like(y_small))
    with pytest.raises(ShapeMismatchError, match="maximum"):
        plan.check("input.0", torch.randn(7, 10, 32))
    with pytest.raises(ShapeMismatchError):
        plan.check("input.0", torch.randn(6, 11, 32))  # seq is static

    # batch and sequence both dynamic: the output follows both
    both = discover(block, x, dynamic={"batch": 0, "seq": 1})
    assert both["output.0"].dynamic == (True, True, False)
    (y_small,) = real_outputs(block, torch.randn(2, 4, 32))
    both.check("output.0", y_small)
    assert all(not s.is_dynamic for s in both.params)


def test_kwargs_and_tuple_outputs() -> None:
    torch.manual_seed(0)
    model = KwargsTuple()
    x, mask = torch.randn(5, 8), torch.ones(5, 6)
    plan = discover(model, x, mask=mask, scale=2.0, dynamic={0: 0, "mask": 0})

    assert [s.name for s in plan.inputs] == ["input.0", "input.mask"]
    assert_matches(plan["input.mask"], mask)
    assert plan["input.mask"].dynamic == (True, False)
    truth = real_outputs(model, x, mask=mask, scale=2.0)  # h, logits, pred (the int 3 is not a tensor)
    assert [s.name for s in plan.outputs] == ["output.0", "output.1", "output.2"]
    for spec, t in zip(plan.outputs, truth):
        assert_matches(spec, t)
    assert plan["output.2"].dtype == "int64"
    assert [s.dynamic for s in plan.outputs] == [(True, False), (True, False), (True,)]
    # integer outputs get no gradient
    assert [s.name for s in plan.grads_of_outputs] == ["grad.output.0", "grad.output.1"]
    assert [s.name for s in plan.grads_of_inputs] == ["grad.input.0", "grad.input.mask"]

    # the same module without the optional kwarg
    plain = discover(model, x)
    assert [s.name for s in plain.inputs] == ["input.0"]
    for spec, t in zip(plain.outputs, real_outputs(model, x)):
        assert_matches(spec, t)


def test_embedding_stage_int64_tokens() -> None:
    torch.manual_seed(0)
    stage = EmbeddingStage()
    tokens = torch.randint(0, 100, (4, 12), dtype=torch.int64)
    plan = discover(stage, tokens, dynamic={"input.0": [0, 1]})

    assert plan["input.0"].dtype == "int64" and plan["input.0"].dynamic == (True, True)
    assert plan.grads_of_inputs == [] and "grad.input.0" not in plan
    (y,) = real_outputs(stage, tokens)
    assert_matches(plan["output.0"], y)
    assert plan["output.0"].dynamic == (True, True, False)
    assert plan["grad.output.0"].shape == (4, 12, 24)
    assert plan["param.emb.weight"].shape == (100, 24)
    assert [s.name for s in plan.grads_of_params] == [
        "grad.param.emb.weight",
        "grad.param.norm.weight",
        "grad.param.norm.bias",
    ]
    with pytest.raises(ShapeMismatchError, match="input.0"):
        plan.check("input.0", tokens.to(torch.int32))
    plan.check("input.0", tokens[:2, :5])


# ---------------------------------------------------------------------------
# tracer fallbacks
# ---------------------------------------------------------------------------
def test_data_dependent_control_flow_falls_back_to_eager() -> None:
    torch.manual_seed(0)
    model = DataDependent()
    x = torch.randn(6, 4)
    snap = snapshot(model)
    plan = discover(model, x, dynamic=0)

    assert plan.method == "eager"
    assert [m for m, _ in plan.attempts] == ["export", "fx", "meta"]
    assert all(reason for _, reason in plan.attempts)
    for branch_input in (x.abs(), -x.abs()):  # both branches give the same shape
        (y,) = real_outputs(model, branch_input)
        assert_matches(plan["output.0"], y)
    assert plan["output.0"].dynamic == (True, False)
    assert_untouched(model, snap)
    assert "export failed" in str(plan)

    # forbidding the real forward: a clear error listing every failed tracer
    with pytest.raises(ConfigError, match="export: .*fx: .*meta: "):
        discover_call(model, (x,), methods=("export", "fx", "meta"))


def test_fx_fallback_when_export_rejects_an_input() -> None:
    model = WithConfig()
    x = torch.randn(5, 4)
    plan = discover(model, x, cfg=Cfg(3), dynamic=0)
    assert plan.method == "fx"
    assert [m for m, _ in plan.attempts] == ["export"]
    assert "Unsupported input type" in plan.attempts[0][1]
    assert [s.name for s in plan.inputs] == ["input.0"]  # a non-tensor kwarg is a constant
    (y,) = real_outputs(model, x, cfg=Cfg(3))
    assert_matches(plan["output.0"], y)
    assert plan["output.0"].dynamic == (True, False)


def test_meta_fallback_when_fake_tensors_fail() -> None:
    model = NeedsStorage()
    x = torch.randn(7, 4)
    snap = snapshot(model)
    plan = discover(model, x, dynamic=0)
    assert plan.method == "meta"
    assert [m for m, _ in plan.attempts] == ["export", "fx"]
    (y,) = real_outputs(model, x)
    assert_matches(plan["output.0"], y)  # meta outputs are reported on the real device
    assert plan["output.0"].dynamic == (True, False)
    assert_untouched(model, snap)


class Specialises(nn.Module):
    """Hard-codes a size, so torch.export specialises the dynamic dim."""

    def forward(self, x):
        return x.reshape(8, -1) * 2


def test_export_specialisation_falls_back_to_two_static_traces() -> None:
    model = Specialises()
    x = torch.randn(8, 4)
    plan = discover(model, x, dynamic=0)
    assert plan.method == "export"
    (y,) = real_outputs(model, x)
    assert_matches(plan["output.0"], y)
    # at batch 4 the output is (8, 2): dim 1 varies with the input's batch, dim 0 does not
    assert plan["output.0"].dynamic == (False, True)
    (y_small,) = real_outputs(model, x[:4])
    plan.check("output.0", y_small)
    # the failed dynamic export left no dynamic-dim marks on the caller's tensor
    exported = torch.export.export(model, (x,), strict=False)
    assert exported.module()(x).shape == y.shape


@pytest.mark.parametrize("method", METHODS)
def test_every_tracer_agrees(method) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, kernel_size=3, stride=2, padding=1), nn.ReLU())
    x = torch.randn(4, 3, 21)
    snap = snapshot(model)
    plan = discover_call(model, (x,), dynamic={"batch": 0, "length": 2}, methods=(method,))
    assert plan.method == method
    (y,) = real_outputs(model, x)
    assert_matches(plan["output.0"], y)
    assert plan["output.0"].dynamic == (True, False, True)  # ceil(L/2) follows L
    (y_small,) = real_outputs(model, x[:2, :, :9])
    plan.check("output.0", y_small)
    assert_untouched(model, snap)


def test_data_dependent_output_size_is_an_error() -> None:
    class Select(nn.Module):
        def forward(self, x):
            return x[x > 0]

    with pytest.raises(SpecError, match="output.0.*tensor values"):
        discover(Select(), torch.randn(10))


# ---------------------------------------------------------------------------
# no training step
# ---------------------------------------------------------------------------
class Trainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.drop = nn.Dropout(0.5)
        self.lin2 = nn.Linear(12, 3)
        self.lin2.bias.requires_grad_(False)

    def forward(self, x):
        return self.lin2(self.drop(torch.relu(self.bn(self.lin1(x)))))


@pytest.mark.parametrize("method", METHODS)
def test_parameters_grads_and_buffers_untouched(method) -> None:
    torch.manual_seed(0)
    model = Trainable().train()
    model.lin1.weight.grad = torch.full_like(model.lin1.weight, 0.25)  # an accumulated grad stays as it is
    x = torch.randn(5, 6, requires_grad=True)
    snap = snapshot(model)

    plan = discover_call(model, (x,), dynamic=0, methods=(method,))

    assert plan.method == method
    assert_untouched(model, snap)
    assert x.grad is None
    assert plan["output.0"].shape == (5, 3) and plan["output.0"].dynamic == (True, False)
    # frozen parameters are listed, but get no gradient spec
    assert "param.lin2.bias" in plan and "grad.param.lin2.bias" not in plan
    assert [s.name for s in plan.buffers] == [
        "buffer.bn.running_mean",
        "buffer.bn.running_var",
        "buffer.bn.num_batches_tracked",
    ]
    assert plan["buffer.bn.num_batches_tracked"].dtype == "int64"


# ---------------------------------------------------------------------------
# contract: names, the Plan object, checks
# ---------------------------------------------------------------------------
class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight  # tied: listed once, under its first name
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, pair, flag, c, *, extra, label):
        a, b = pair
        h = self.enc(a) + b
        out = self.dec(h) + extra[0] * extra[1]
        return {"z": out.sum(-1), "h": h}, [c.long() + label, None]


def test_naming_contract() -> None:
    model = Nested()
    a, b, c = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2)
    extra = [torch.randn(4), torch.randn(4)]
    label = torch.zeros(2, dtype=torch.int64)
    plan = discover(model, (a, b), True, c, extra=extra, label=label, dynamic={"batch": {0: 0, 1: 0}})

    # positional tensor leaves are numbered in flattened order, non-tensors skipped
    assert [s.name for s in plan.inputs] == [
        "input.0",
        "input.1",
        "input.2",
        "input.extra.0",
        "input.extra.1",
        "input.label",
    ]
    for spec, t in zip(plan.inputs, [a, b, c, *extra, label]):
        assert_matches(spec, t)
    truth = real_outputs(model, (a, b), True, c, extra=extra, label=label)
    assert [s.name for s in plan.outputs] == ["output.0", "output.1", "output.2"]
    for spec, t in zip(plan.outputs, truth):
        assert_matches(spec, t)
    assert [s.name for s in plan.grads_of_inputs] == [
        "grad.input.0",
        "grad.input.1",
        "grad.input.2",
        "grad.input.extra.0",
        "grad.input.extra.1",
    ]
    assert [s.name for s in plan.grads_of_outputs] == ["grad.output.0", "grad.output.1"]
    for g in plan.grads_of_inputs + plan.grads_of_outputs:
        assert g == plan[g.name.removeprefix("grad.")].with_name(g.name)
    assert [s.is_dynamic for s in plan.inputs] == [True, True, False, False, False, False]

    assert [s.name for s in plan.params] == ["param.frozen", "param.enc.weight", "param.enc.bias", "param.dec.bias"]
    assert [s.name for s in plan.grads_of_params] == [
        "grad.param.enc.weight",
        "grad.param.enc.bias",
        "grad.param.dec.bias",
    ]
    assert [s.name for s in plan.buffers] == ["buffer.step"]  # non-persistent buffers are not state
    assert list(plan.all) == [s.name for g in Plan.groups for s in plan.group(g)]
    assert all(plan.all[n] is plan[n] for n in plan.all)
    assert list(plan) == list(plan.all.values())

    # immutable, lists are copies
    with pytest.raises(AttributeError):
        plan.method = "fx"  # type: ignore[misc]
    plan.inputs.clear()
    assert len(plan.inputs) == 6
    with pytest.raises(NotFoundError, match="input.3"):
        plan["input.3"]
    with pytest.raises(KeyError):
        plan["nope"]
    assert isinstance(hash(plan), int)


def test_check_against_the_declared_maximum() -> None:
    plan = discover(mlp(), torch.randn(8, 16), dynamic=0)
    plan.check("input.0", torch.randn(8, 16))
    plan.check("input.0", torch.randn(1, 16))
    plan.check("output.0", torch.randn(3, 10))
    with pytest.raises(ShapeMismatchError, match=r"input.0: dim 0 is 9, larger than its declared maximum 8"):
        plan.check("input.0", torch.randn(9, 16))
    with pytest.raises(ShapeMismatchError, match="grad.output.0"):
        plan.check("grad.output.0", torch.randn(16, 10))
    with pytest.raises(ShapeMismatchError, match="float16"):
        plan.check("input.0", torch.randn(8, 16, dtype=torch.float16))
    with pytest.raises(ShapeMismatchError):
        plan.check("param.0.weight", torch.randn(64, 17))
    with pytest.raises(NotFoundError):
        plan.check("input.1", torch.randn(8, 16))
    assert isinstance(ShapeMismatchError("x"), TensorWireError)


def test_dynamic_forms_are_equivalent() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x, *, mask):
            return x * mask

    x, mask = torch.randn(6, 5), torch.ones(6, 5)
    # "dim 0 of every input"
    ref = discover_call(TwoInputs(), (x,), {"mask": mask}, dynamic=0, methods=("meta",))
    assert [s.dynamic for s in ref.inputs] == [(True, False), (True, False)]
    assert ref["output.0"].dynamic == (True, False)
    for form in (
        [0],
        (-2,),
        {0: 0, "mask": [0]},
        {0: [0], "input.mask": 0},
        {"input.0": -2, "mask": 0},
        {"batch": 0},
        {"batch": {0: 0, "mask": 0}},
    ):
        assert discover_call(TwoInputs(), (x,), {"mask": mask}, dynamic=form, methods=("meta",)) == ref, form
    # one input only
    only_x = discover_call(TwoInputs(), (x,), {"mask": mask[:1]}, dynamic={0: [0]}, methods=("meta",))
    assert [s.dynamic for s in only_x.inputs] == [(True, False), ()]
    assert only_x["output.0"].dynamic == (True, False)
    # nothing dynamic
    for form in (None, False, {}, []):
        static = discover_call(TwoInputs(), (x,), {"mask": mask}, dynamic=form, methods=("meta",))
        assert not any(s.is_dynamic for s in static.all.values()), form


def test_plan_is_deterministic_and_sizes_are_maxima() -> None:
    model = EmbeddingStage()
    tokens = torch.randint(0, 100, (4, 12))
    p1 = discover(model, tokens, dynamic=[0, 1])
    p2 = discover(model, tokens, dynamic={"batch": 0, "seq": 1})
    assert p1 == p2
    assert p1["output.0"].nbytes == 4 * 12 * 24 * 4
    assert p1.nbytes_by_group["grads_of_outputs"] == p1["output.0"].nbytes


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_bad_input_errors() -> None:
    model = mlp()
    x = torch.randn(8, 16)
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        discover(lambda t: t, x)
    with pytest.raises(ConfigError, match="at least one tensor"):
        discover(model)
    with pytest.raises(ConfigError, match="at least one tensor"):
        discover(model, 3, flag=True)
    with pytest.raises(SpecError, match=r"input.0.*complex128"):
        discover(model, torch.randn(8, 16, dtype=torch.complex128))
    with pytest.raises(SpecError, match=r"input.y.*complex"):
        discover(KwargsTuple(), x[:, :8], y=torch.zeros(3, dtype=torch.complex128))

    class ComplexParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, dtype=torch.complex128))

        def forward(self, x):
            return x

    with pytest.raises(SpecError, match=r"param.w.*complex128"):
        discover(ComplexParam(), x)

    with pytest.raises(ConfigError, match=r"dim 2 is out of range for input.0 with shape \(8, 16\)"):
        discover(model, x, dynamic=2)
    with pytest.raises(ConfigError, match="out of range"):
        discover(model, x, dynamic={0: [-3]})
    with pytest.raises(ConfigError, match="out of range"):
        discover(model, x, dynamic={"batch": 5})
    with pytest.raises(ConfigError, match="no positional tensor input 1"):
        discover(model, x, dynamic={1: 0})
    with pytest.raises(ConfigError, match="no input named 'input.mask'"):
        discover(model, x, dynamic={"input.mask": 0})
    with pytest.raises(ConfigError, match="named dim 'batch': no input 'mask'"):
        discover(model, x, dynamic={"batch": {"mask": 0}})
    for bad in (True, "batch", 1.5, {0: "x"}, {0: None}, {0: [True]}):
        with pytest.raises(ConfigError):
            discover(model, x, dynamic=bad)
    with pytest.raises(ConfigError, match="methods"):
        discover_call(model, (x,), methods=("jit",))
    with pytest.raises(ConfigError, match="could not trace"):
        discover(model, torch.randn(8, 15))  # wrong example: no tracer can run it
    assert issubclass(ConfigError, TensorWireError)
