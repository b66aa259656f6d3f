"""Sensitivity per layer and scheme, the multiple-choice knapsack behind the bit allocation
(against brute force), and allocation against uniform quantization on a small real task."""
from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fewbits.quant import QuantScheme, get_scheme, quantize
from fewbits.quant.model import model_nbytes
from fewbits.quant.sensitivity import (FLOAT, LayerInfo, SensitivityRecord, SensitivityTable, allocate_bits,
                                       apply_allocation, knapsack_brute_force, lagrangian_lower_bound,
                                       layer_sensitivity, solve_knapsack, sqnr_db, uniform_allocation)


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the knapsack ---------------------------------------------------------------------------
def _random_instance(rng, groups, options):
    costs = [[rng.uniform(-0.05, 1.0) for _ in range(options)] for _ in range(groups)]
    sizes = [[rng.randint(1, 60) * rng.choice([1, 4, 8]) for _ in range(options)] for _ in range(groups)]
    lo, hi = sum(min(s) for s in sizes), sum(max(s) for s in sizes)
    return costs, sizes, rng.randint(lo, hi)


def test_knapsack_agrees_with_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        costs, sizes, budget = _random_instance(rng, rng.randint(1, 6), rng.randint(1, 4))
        choice, best_cost, _ = knapsack_brute_force(costs, sizes, budget)
        sol = solve_knapsack(costs, sizes, budget)
        assert sol.exact
        assert sol.size <= budget
        assert sol.size == sum(sizes[i][j] for i, j in enumerate(sol.choice))
        assert sol.cost == pytest.approx(best_cost, abs=1e-12)
        assert sol.lower_bound <= best_cost + 1e-12


def test_knapsack_at_coarse_resolution_still_fits_and_stays_near_the_optimum():
    rng = random.Random(1)
    for _ in range(200):
        costs, sizes, budget = _random_instance(rng, rng.randint(2, 6), rng.randint(2, 4))
        _, best_cost, _ = knapsack_brute_force(costs, sizes, budget)
        sol = solve_knapsack(costs, sizes, budget, resolution=4)
        assert sol.size <= budget  # sizes are rounded up: the plan always fits
        assert sol.cost >= best_cost - 1e-12
        assert sol.lower_bound <= best_cost + 1e-12


def test_knapsack_lower_bound_is_tight_on_a_convex_instance():
    # equal groups with convex cost curves: the Lagrangian bound meets the optimum
    costs = [[4.0, 2.0, 1.0, 0.5]] * 5
    sizes = [[1, 2, 3, 4]] * 5
    sol = solve_knapsack(costs, sizes, 10)
    assert sol.cost == pytest.approx(knapsack_brute_force(costs, sizes, 10)[1])
    assert sol.lower_bound == pytest.approx(sol.cost)
    assert lagrangian_lower_bound(costs, sizes, 20) == pytest.approx(2.5)


def test_knapsack_bad_input():
    with pytest.raises(ValueError, match="smallest feasible size 3"):
        solve_knapsack([[1.0, 2.0]] * 3, [[1, 2]] * 3, 2)
    with pytest.raises(ValueError, match="same non-empty"):
        solve_knapsack([[1.0]], [[1, 2]], 5)
    with pytest.raises(ValueError, match="NaN"):
        solve_knapsack([[float("nan")]], [[1]], 5)


# --- allocation on a synthetic table --------------------------------------------------------
def _table(rng, n_layers=5, n_schemes=3):
    schemes = {f"s{k}": QuantScheme("int8", "channel", name=f"s{k}") for k in range(n_schemes)}
    layers, records = [], []
    for i in range(n_layers):
        params = rng.choice([256, 512, 1024])
        layers.append(LayerInfo(f"layer{i}", (params // 16, 16), params, 4 * params))
        for k, label in enumerate(schemes):
            bits = 2 + 2 * k + rng.random()
            nbytes = int(params * bits / 8)
            sq = 6.0 * bits + rng.uniform(-3, 3)
            records.append(SensitivityRecord(f"layer{i}", label, params, nbytes, nbytes * 8 / params, sq + 5, sq,
                                             loss_increase=rng.uniform(0, 1) * 2.0 ** (-bits)))
    return SensitivityTable(layers, schemes, records, base_loss=1.0, batches=1)


@pytest.mark.parametrize("metric", ["loss", "sqnr"])
def test_allocation_is_the_brute_force_optimum(metric):
    rng = random.Random(2)
    for _ in range(20):
        table = _table(rng)
        costs = [[(r.loss_increase if metric == "loss" else 10 ** (-r.output_sqnr_db / 10))
                  for r in table.records if r.layer == li.name] for li in table.layers]
        sizes = [[r.nbytes for r in table.records if r.layer == li.name] for li in table.layers]
        budget = rng.randint(sum(map(min, sizes)), sum(map(max, sizes)))
        alloc = allocate_bits(table, budget_bytes=budget, metric=metric)
        _, best_cost, _ = knapsack_brute_force(costs, sizes, budget)
        assert alloc.cost == pytest.approx(best_cost, abs=1e-12)
        assert alloc.predicted_bytes <= budget
        chosen = [table.record(n, label) for n, label in alloc.choices.items()]
        assert alloc.predicted_bytes == sum(r.nbytes for r in chosen)
        assert alloc.predicted_loss_increase == pytest.approx(sum(r.loss_increase for r in chosen))
        noise = sum(10 ** (-r.output_sqnr_db / 10) for r in chosen)
        assert alloc.predicted_sqnr_db == pytest.approx(-10 * math.log10(noise))
        assert set(alloc.plan) == {li.name for li in table.layers}
        assert all(alloc.plan[n] is table.schemes[label] for n, label in alloc.choices.items())


def test_allocation_budget_in_bits_per_param_float_option_and_errors():
    table = _table(random.Random(3))
    params = sum(li.params for li in table.layers)
    alloc = allocate_bits(table, budget_bits_per_param=5.0)
    assert alloc.budget_bytes == math.floor(5.0 * params / 8)
    assert alloc.bits_per_param <= 5.0
    # with float allowed and a float-sized budget, every layer stays float at zero cost
    full = allocate_bits(table, budget_bytes=sum(li.float_nbytes for li in table.layers), include_float=True)
    assert set(full.choices.values()) == {FLOAT} and all(v is None for v in full.plan.values())
    assert full.cost == 0
    smallest = sum(min(r.nbytes for r in table.records if r.layer == li.name) for li in table.layers)
    with pytest.raises(ValueError, match=f"smallest feasible budget is {smallest} bytes"):
        allocate_bits(table, budget_bytes=smallest - 1)
    with pytest.raises(ValueError, match="exactly one"):
        allocate_bits(table, budget_bytes=100, budget_bits_per_param=4)
    with pytest.raises(ValueError, match="metric"):
        allocate_bits(table, budget_bytes=10 ** 6, metric="mse")
    no_loss = SensitivityTable(table.layers, table.schemes,
                               [SensitivityRecord(**{**r.__dict__, "loss_increase": None}) for r in table.records])
    with pytest.raises(ValueError, match="metric='sqnr'"):
        allocate_bits(no_loss, budget_bytes=10 ** 6)
    text = json.loads(alloc.to_json())
    assert text["predicted_bytes"] == alloc.predicted_bytes and text["choices"] == alloc.choices
    assert "bits/param" in str(alloc)


# --- sensitivity on a small model -----------------------------------------------------------
class TiedMLP(nn.Module):
    """Two layers share one weight (as tied embeddings and heads do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.b.weight = self.a.weight
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _xy_batches(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=gen), torch.randint(0, 8, (16,), generator=gen)) for _ in range(n)]


def _ce(out, batch):
    return F.cross_entropy(out, batch[1])


def test_sensitivity_restores_weights_bit_exactly_and_measures_one_layer_at_a_time():
    model = TiedMLP().train()
    params_before = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    values_before = {n: p.detach().clone() for n, p in params_before.items()}
    batches = _xy_batches()
    schemes = ["int8", "int4_channel", QuantScheme("int2", "channel", name="int2c")]
    table = layer_sensitivity(model, schemes, batches, loss_fn=_ce, input_fn=lambda b: b[0], tied="untie")
    assert model.training  # mode restored
    for n, p in model.named_parameters(remove_duplicate=False):
        assert p is params_before[n]
        assert torch.equal(p.detach().view(torch.int32), values_before[n].view(torch.int32))
    assert model.b.weight is model.a.weight

    assert [li.name for li in table.layers] == ["a", "b", "head"]
    assert len(table.records) == 9 and table.batches == 3
    # independently: quantize only layer "b" (its own copy of the tied weight) and measure
    for label in ("int8", "int4_channel", "int2c"):
        ref = copy.deepcopy(model).eval()
        with torch.no_grad():
            float_out = [ref(x) for x, _ in batches]
            float_loss = sum(float(F.cross_entropy(o, y)) for o, (_, y) in zip(float_out, batches)) / 3
            ref.b.weight = nn.Parameter(quantize(ref.a.weight, table.schemes[label]).dequantize())
            q_out = [ref(x) for x, _ in batches]
            q_loss = sum(float(F.cross_entropy(o, y)) for o, (_, y) in zip(q_out, batches)) / 3
        signal = sum(float(o.double().square().sum()) for o in float_out)
        noise = sum(float((q.double() - o.double()).square().sum()) for q, o in zip(q_out, float_out))
        rec = table.record("b", label)
        assert rec.output_sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)
        assert rec.loss_increase == pytest.approx(q_loss - float_loss, abs=1e-9)
        assert rec.nbytes == table.schemes[label].nbytes((32, 32))
    assert table.base_loss == pytest.approx(float_loss, abs=1e-9)
    # more bits, less noise, for every layer
    for li in table.layers:
        sq = [table.record(li.name, s).output_sqnr_db for s in ("int8", "int4_channel", "int2c")]
        assert sq[0] > sq[1] > sq[2]
        assert table.record(li.name, "int8").weight_sqnr_db > 40
    d = json.loads(table.to_json())
    assert len(d["records"]) == 9 and d["schemes"]["int2c"]["format"] == "int2"
    assert "head" in str(table) and "loss increase" in str(table)


def test_sensitivity_of_w8a8_quantizes_the_layer_input_too():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 6))
    x = torch.randn(12, 24) * 3
    table = layer_sensitivity(model, ["w8a8", "int8"], [x])
    act = get_scheme("w8a8").activations  # per-token int8
    with torch.no_grad():
        ref = model(x)
        w2 = quantize(model[2].weight, "w8a8").dequantize()
        h = torch.relu(model[0](x))
        hq = quantize(h, act).dequantize()
        out = F.linear(hq, w2, model[2].bias)
    want = sqnr_db(float(ref.double().square().sum()), float((out.double() - ref.double()).square().sum()))
    assert table.record("2", "w8a8").output_sqnr_db == pytest.approx(want, rel=1e-9)
    # the activation rounding costs extra noise over weight-only int8
    assert table.record("2", "w8a8").output_sqnr_db < table.record("2", "int8").output_sqnr_db
    assert not model[2]._forward_pre_hooks  # the hook is gone


def test_sensitivity_without_loss_and_errors():
    model = TiedMLP()
    x = [b[0] for b in _xy_batches(2)]
    table = layer_sensitivity(model, ["int8", "bf16"], x, skip=["head"], tied="untie")
    assert [li.name for li in table.layers] == ["a", "b"]
    # by default the tied layers are kept in float, as quantize_model keeps them
    assert [li.name for li in layer_sensitivity(model, ["int8"], x).layers] == ["head"]
    assert not table.has_loss and table.base_loss is None
    assert table.record("a", "int8").loss_increase is None
    with pytest.raises(ValueError, match="share the label"):
        layer_sensitivity(model, ["int8", QuantScheme("int8", "channel", name="int8")], x)
    with pytest.raises(ValueError, match="empty"):
        layer_sensitivity(model, ["int8"], [])
    with pytest.raises(ValueError, match="no quantizable layer"):
        layer_sensitivity(model, ["int8"], x, skip="*")
    with pytest.raises(KeyError, match="no record"):
        table.record("head", "int8")
    assert sqnr_db(1.0, 0.0) == math.inf


# --- allocation against uniform, on a real task ---------------------------------------------
CANDIDATES = [
    QuantScheme("int2", "channel", name="int2c"),
    QuantScheme("int3", "channel", name="int3c"),
    QuantScheme("int4", "channel", name="int4c"),
    QuantScheme("int5", "channel", name="int5c"),
    QuantScheme("int3", "group", group_size=32, scale_format="fp16", name="int3g32"),
    QuantScheme("int4", "group", group_size=32, scale_format="fp16", name="int4g32"),
]


@pytest.fixture(scope="module")
def tiny_sensitivity():
    from fewbits.models.tiny import tiny_charlm_model, tiny_task, train_classifier
    task = tiny_task(0)
    x, y = task.train
    threads = torch.get_num_threads()  # a module fixture runs before the one_thread fixture
    torch.set_num_threads(1)
    try:
        # The tiny task's model trained again, in float64, then cast to float32: trained in float32,
        # its 600 Adam steps grow the last-bit differences between CPU kernel sets (MKL's sgemm,
        # ATen's vector code) into another model on every kind of CPU (weights up to 76 % apart,
        # ATEN_CPU_CAPABILITY=avx2 against avx512); in float64 they stay within 5e-15 and the
        # float32 weights come out bit for bit the same under avx2 and avx512, with MKL's own
        # kernels and with MKL_ENABLE_INSTRUCTIONS=AVX2. (Under ATEN_CPU_CAPABILITY=default, as on
        # a CPU without AVX2, torch's scalar normal_/uniform_ round the initial weights differently
        # in their last bits, so it gets another model.)
        model = train_classifier(tiny_charlm_model(0).double(), x, y, seed=0).float().eval()
        task = task._replace(model=model)
        # all 40,000 training windows: with 4,000 the measured loss increases were off by up to
        # 0.007 in the allocation's predicted gain, enough to pick a plan 0.009 worse than the best
        calibration = [(x[i:i + 5000], y[i:i + 5000]) for i in range(0, len(x), 5000)]
        table = layer_sensitivity(task.model, CANDIDATES, calibration, loss_fn=_ce, input_fn=lambda b: b[0],
                                  embeddings=True)
    finally:
        torch.set_num_threads(threads)
    return task, table


# (uniform scheme, least gain in mean cross-entropy on the 8,000 held-out windows). Measured gains:
#                                        int3g32        int4g32
#   this model, under 6 kernel sets (*)  0.076 (0.079)  0.0095 (0.0155)  (brackets: avx2-less)
#   16 other models: seeds 1-7 trained   0.047 - 0.104  0.0045 - 0.033, and 0.0016 once
#   in float64 and in float32, seed 0 in float32 under the 6 kernel sets
# For one model the gain is the same under every kernel set to 0.0001, and the allocation's plan is
# the best of all 6^4 plans within the budget measured on the eval windows themselves (for the
# float32 models: within 0.002 of it, 0.007 once). Not at int4c's budget, which this test used
# before: there uniform int4c is often that best plan itself (for seed 0 trained in float32, under
# four of the six kernel sets), the allocation's predicted edge is of the size of its prediction
# error, and it measured from 0.017 worse to 0.045 better by model; asking it to win there by 0.01
# passed or failed by the model, which the CPU decided.
# (*) ATEN_CPU_CAPABILITY=avx2 / avx512 / default, MKL_ENABLE_INSTRUCTIONS=AVX2 with avx512 and
# with avx2, MKL_ENABLE_INSTRUCTIONS=SSE4_2 with default. oneDNN's AMX (ONEDNN_MAX_CPU_ISA) changed nothing.
@pytest.mark.parametrize("uniform_label, min_gain", [("int3g32", 0.04), ("int4g32", 0.004)])
def test_allocation_beats_uniform_at_the_same_budget(tiny_sensitivity, uniform_label, min_gain):
    task, table = tiny_sensitivity
    ex, ey = task.eval
    data = [(ex, ey)]
    uniform = uniform_allocation(table, uniform_label)
    alloc = allocate_bits(table, budget_bytes=uniform.predicted_bytes)
    assert alloc.predicted_bytes <= uniform.predicted_bytes
    assert alloc.predicted_loss_increase < uniform.predicted_loss_increase
    assert len(set(alloc.choices.values())) > 1  # a real mix

    measured = {}
    for name, plan in (("uniform", uniform), ("alloc", alloc)):
        model = copy.deepcopy(task.model)
        report = apply_allocation(model, plan, data, loss_fn=_ce, input_fn=lambda b: b[0])
        # sizes predicted before quantizing == bytes after: stored (codes, scales), held by the
        # modules (kernel extras included) and the whole model's
        assert report.measured_stored_bytes == report.predicted_stored_bytes == plan.stored_bytes
        assert report.measured_held_bytes == report.predicted_held_bytes == plan.held_bytes
        assert report.measured_model_bytes == report.predicted_model_bytes == model_nbytes(model)["total"]
        assert report.measured_sqnr_db == pytest.approx(report.predicted_sqnr_db, abs=3.0)
        measured[name] = (report.measured_loss, task.evaluate(model), report)
    # on held-out text the allocation's loss is lower than uniform's at no more bytes
    assert measured["alloc"][0] < measured["uniform"][0] - min_gain
    assert measured["alloc"][1] >= measured["uniform"][1] - 0.002
    assert "predicted" in str(measured["alloc"][2])
    json.dumps(measured["alloc"][2].to_dict(), allow_nan=False)


def test_allocation_on_held_bytes_fits_what_the_modules_hold(tiny_sensitivity):
    task, table = tiny_sensitivity
    # kernels may keep extras (torch's int4 matmul: bfloat16 scale copies): held >= stored
    r = table.record("2", "int4c")
    assert r.held_nbytes >= r.nbytes == table.schemes["int4c"].nbytes((128, 128))
    budget = uniform_allocation(table, "int4c", sizes="held").predicted_bytes
    alloc = allocate_bits(table, budget_bytes=budget, sizes="held")
    assert alloc.sizes == "held" and alloc.held_bytes <= budget
    model = copy.deepcopy(task.model)
    report = apply_allocation(model, alloc)
    assert report.measured_held_bytes == alloc.held_bytes
    assert report.measured_model_bytes == report.predicted_model_bytes
    with pytest.raises(ValueError, match="sizes must be"):
        allocate_bits(table, budget_bytes=budget, sizes="disk")
